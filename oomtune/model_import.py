"""Where a model file's own imports come from: its folder first on sys.path while it is imported, as `python
model.py` would have it, and a neighbour of another model file's folder under the same name not reused."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

_FOLDERS: set[str] = set()  # the folders model files were loaded from


def neighbours_first(folder: Path) -> tuple[str, int | None, dict]:
    """As `python model.py` would: the file imports its neighbours (`from model import GPT`), its own folder first
    on sys.path while it is imported (returned, with where it was on sys.path before, None: not there; the caller
    puts it back there, else last). A neighbour another model file's folder imported under the same name (two
    projects' `utils.py`, loaded one after the other through the API) is dropped from sys.modules, so this file
    imports its own. One the caller's own code imported (a notebook's `utils.py` beside it) is set aside the same
    way and returned, for the caller to put back once the file is imported (the notebook keeps its own)."""
    here = str(folder)
    was = sys.path.index(here) if here in sys.path else None
    if was is not None:
        sys.path.remove(here)
    sys.path.insert(0, here)
    _FOLDERS.add(here)
    others = _FOLDERS - {here}
    libraries = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
    names = {f.stem for f in folder.glob("*.py")} | {d.name for d in folder.iterdir() if (d / "__init__.py").is_file()}
    aside: dict = {}
    for name in names:
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        if file is None:
            continue
        home = Path(file).resolve().parent
        home = str(home.parent if hasattr(module, "__path__") else home)  # (a package: its folder's)
        if home == here or (home not in others and home.startswith(libraries)):
            continue  # this file's own, or a library's (sys.modules keeps it)
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            module = sys.modules.pop(loaded)
            if home not in others:
                aside[loaded] = module
    return here, was, aside


API_CALLS = ("probe", "estimate", "check", "train", "what_if")  # oomtune's functions a script would call


def _is_main_guard(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) and "__main__" in ast.unparse(node.test)


def unguarded_api_call(path: Path) -> tuple[str, int] | None:
    """(function, line) of the first call to one of oomtune's functions (by name: `oomtune.probe(...)`,
    `probe(...)`) that importing the script at `path` would run: at its top level, outside function and class
    bodies and an `if __name__ == "__main__":` block. None where there is none, or the file does not parse."""
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError, ValueError):
        return None
    skipped = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
    todo, calls = [s for s in tree.body if not _is_main_guard(s)], []
    while todo:
        node = todo.pop()
        if isinstance(node, skipped):
            continue
        if isinstance(node, ast.Call):
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            if name in API_CALLS:
                calls.append((node.lineno, name))
        todo.extend(ast.iter_child_nodes(node))
    return (min(calls)[1], min(calls)[0]) if calls else None
