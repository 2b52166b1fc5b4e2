"""The layout the design promises, checked on the source tree (no device: nothing runs but `ast`)."""

from __future__ import annotations

import ast
from pathlib import Path

from .conftest import ROOT

PACKAGE = ROOT / "oomtune"
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_LOOSE_MODULES = 400, 80, 12


def python_files(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py") if "__pycache__" not in p.parts)


def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in python_files("oomtune", "tests", "bench", "scripts", "examples")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_no_function_in_the_package_is_over_80_lines():
    long = {f"{p.relative_to(ROOT)}:{node.name}": node.end_lineno - node.lineno + 1
            for p in python_files("oomtune") for node in ast.walk(tree(p))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES}
    assert long == {}


def test_no_mixins_and_few_loose_modules():
    mixins = [f"{p.relative_to(ROOT)}:{n.name}" for p in python_files("oomtune") for n in ast.walk(tree(p))
              if isinstance(n, ast.ClassDef) and n.name.endswith("Mixin")]
    assert mixins == []
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(loose) <= MAX_LOOSE_MODULES, loose


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_the_ladder_search_imports_no_torch():
    ladder = PACKAGE / "search" / "ladder.py"
    assert "class LadderSearch" in ladder.read_text()
    assert "torch" not in imported_modules(ladder)


def test_only_the_cli_prints():
    printers = []
    for p in python_files("oomtune"):
        if p.is_relative_to(PACKAGE / "cli"):
            continue
        for node in ast.walk(tree(p)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                printers.append(f"{p.relative_to(ROOT)}:{node.lineno}")
        if "rich" in imported_modules(p):
            printers.append(f"{p.relative_to(ROOT)}: imports rich")
    assert printers == []


def test_the_search_commands_are_built_on_the_python_api():
    """probe, estimate and check reach the search through oomtune/api.py, as a script does: no command imports the
    search's entry points itself."""
    entry = {"oomtune.search.probe": {"probe"}, "oomtune.search.estimate": {"estimate", "what_if"},
             "oomtune.search.check": {"check"}}
    bypass = []
    for name in ("probe_cmd", "estimate_cmd", "check_cmd"):
        path = PACKAGE / "cli" / f"{name}.py"
        for node in ast.walk(tree(path)):
            if isinstance(node, ast.ImportFrom) and node.level == 2 and node.module:
                wanted = entry.get(f"oomtune.{node.module}", set())
                bypass += [f"{name}: {node.module}.{a.name}" for a in node.names if a.name in wanted]
        assert "api" in path.read_text(), name
    assert bypass == []


def test_one_file_calls_backward():
    callers = {str(p.relative_to(ROOT)) for p in python_files("oomtune") for node in ast.walk(tree(p))
               if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "backward"}
    assert callers == {"oomtune/step.py"}


def test_pytest_collects_every_test_folder():
    """pytest skips folders named like `dist` or `build` unless told otherwise: tests/dist must not be skipped."""
    import fnmatch

    import tomllib

    ignored = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["norecursedirs"]
    folders = [p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    assert "dist" in folders
    assert [f for f in folders if any(fnmatch.fnmatch(f, pattern) for pattern in ignored)] == []


def test_the_command_line_starts_without_torch():
    """`oomtune --help` and argument errors answer at once: importing the CLI loads no torch (a fresh process)."""
    import subprocess
    import sys

    code = "import sys, oomtune.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"
