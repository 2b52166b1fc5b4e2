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


def absolute_imports(path: Path, source: str | None = None) -> set[str]:
    """Every `module.name` the module at `path` (or `source` as if it were there) imports: relative imports made
    absolute, `import a.b` as `a.b`."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(tree(path) if source is None else ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            module = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            found |= {module} | {f"{module}.{a.name}" for a in node.names}
    return found


def test_the_search_commands_are_built_on_the_python_api():
    """probe, estimate and check reach the search through oomtune/api.py, as a script does: no command imports the
    search's entry points (or their modules whole) itself."""
    entries = {"oomtune.search.probe.probe", "oomtune.search.estimate.estimate", "oomtune.search.estimate.what_if",
               "oomtune.search.check.check", "oomtune.search.probe.probe_on_ranks"}
    modules = {"oomtune.search.probe", "oomtune.search.estimate", "oomtune.search.check"}
    for name in ("probe_cmd", "estimate_cmd", "check_cmd"):
        imported = absolute_imports(PACKAGE / "cli" / f"{name}.py")
        assert imported & entries == set(), name
        assert {m for m in modules if m in imported and not any(i.startswith(m + ".") for i in imported)} == set()
        assert any(i == "oomtune.api" or i.startswith("oomtune.api.") for i in imported), name


def test_the_import_reader_sees_every_form():
    forms = "from ..search.check import check\nfrom oomtune.search import probe\nimport oomtune.search.estimate\n"
    assert {"oomtune.search.check.check", "oomtune.search.probe", "oomtune.search.estimate"} <= \
        absolute_imports(ROOT / "oomtune" / "cli" / "x.py", forms)


def test_one_file_calls_backward():
    callers = {str(p.relative_to(ROOT)) for p in python_files("oomtune") for node in ast.walk(tree(p))
               if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "backward"}
    # (leftovers.py's backward of a scalar leaf trains nothing: it drains what a failed backward left queued)
    assert callers == {"oomtune/step.py", "oomtune/memory/leftovers.py"}


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
