"""A module imported for the first time while a trial is measured runs outside it.

Libraries import others lazily, in the middle of a trial: PEFT imports bitsandbytes as it wraps a model's layers,
transformers imports a model's attention and masking code at its first forward. Module code may make tensors (its
module globals: bitsandbytes' 256-entry quantization map). Made inside the measurement, they were counted as the
device's, and, as globals, lived on: the first trial of a search read 1 KiB more than the same plan traced after
it, on the cpu device as on the fake one. A real run makes them in host memory when it imports the library, never
on the GPU. So while `imports_outside()` is on (simulated devices, inside `measure()`), a module imported for the
first time runs its code outside every dispatch mode (FakeTensorMode included: real tensors, as an import makes
them) and untracked. An import of a module already imported costs nothing more: Python asks the finders only for
a module not in sys.modules (an import that finds nothing, `try: import apex`, asks the finders twice).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
import threading
from collections.abc import Iterator

from torch.utils._python_dispatch import _disable_current_modes

from .tracker import untracked

with _disable_current_modes():  # (it imports modules of its own the first time: not from inside a loader below)
    pass


class _Outside(importlib.abc.Loader):
    """`loader`, with the module's code run outside the measurement; the module keeps `loader` as its own."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        with _disable_current_modes(), untracked():
            return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = self.loader  # (what the module's code and later readers see is the real loader)
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        with _disable_current_modes(), untracked():
            self.loader.exec_module(module)

    def __getattr__(self, name):
        if name == "loader":  # (not set yet: a copy being made)
            raise AttributeError(name)
        return getattr(self.loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """First on sys.meta_path while on: the spec the finders after it give, its loader wrapped (_Outside). Only for
    the thread that measures: another's import (a progress display's) is its own, and running it untracked would
    pause the tracker (every thread's) while the trial goes on. A spec asked for without an import
    (importlib.util.find_spec) has the wrapper too: it acts as the loader does, but is not of its class."""

    def __init__(self) -> None:
        self.owner: int | None = None  # the thread that measures
        self.asking = False  # (a finder after it that asks the finders again: not wrapped twice)

    def find_spec(self, fullname, path, target=None):
        if self.asking or threading.get_ident() != self.owner:
            return None
        self.asking = True
        try:
            for finder in sys.meta_path:
                if finder is self:
                    continue
                if not hasattr(finder, "find_spec"):  # (an old-style finder: Python asks it in its turn)
                    return None
                spec = finder.find_spec(fullname, path, target)
                if spec is None:
                    continue
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Outside(spec.loader)
                return spec
            return None
        finally:
            self.asking = False


_FINDER = _Finder()


@contextlib.contextmanager
def imports_outside() -> Iterator[None]:
    """Inside, modules imported for the first time run their code outside the measurement (module doc). Nested,
    the outermost puts the finder in place and takes it away."""
    if _FINDER in sys.meta_path:
        yield
        return
    _FINDER.owner = threading.get_ident()
    sys.meta_path.insert(0, _FINDER)
    try:
        yield
    finally:
        _FINDER.owner = None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(_FINDER)
