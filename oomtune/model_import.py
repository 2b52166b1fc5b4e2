"""Where a model file's own imports come from: its folder first on sys.path while it is imported, as `python
model.py` would have it, and a neighbour of another model file's folder under the same name not reused."""

from __future__ import annotations

import sys
from pathlib import Path

_FOLDERS: set[str] = set()  # the folders model files were loaded from


def neighbours_first(folder: Path) -> tuple[str, int | None]:
    """As `python model.py` would: the file imports its neighbours (`from model import GPT`), its own folder first
    on sys.path while it is imported (returned, with where it was on sys.path before, None: not there; the caller
    puts it back there, else last). A neighbour another model file's folder imported under the same name (two
    projects' `utils.py`, loaded one after the other through the API) is dropped from sys.modules, so this file
    imports its own."""
    here = str(folder)
    was = sys.path.index(here) if here in sys.path else None
    if was is not None:
        sys.path.remove(here)
    sys.path.insert(0, here)
    _FOLDERS.add(here)
    others = _FOLDERS - {here}
    names = {f.stem for f in folder.glob("*.py")} | {d.name for d in folder.iterdir() if (d / "__init__.py").is_file()}
    for name in names:
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        if file is None:
            continue
        home = Path(file).resolve().parent
        if str(home.parent if hasattr(module, "__path__") else home) in others:  # (a package: its folder's)
            for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[loaded]
    return here, was
