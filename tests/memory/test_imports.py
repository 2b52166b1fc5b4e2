"""A module imported for the first time inside a trial (a library's lazy import) runs outside the measurement: the
tensors its module code makes are not the device's (memory/imports.py). Devices: cpu and fake."""

from __future__ import annotations

import sys
import uuid

import pytest
import torch

from oomtune.config.schema import Plan
from oomtune.memory.devices import CpuDevice, FakeDevice
from oomtune.memory.imports import imports_outside
from oomtune.model_file import load_model_file
from oomtune.search.trial import run_trial

from ..conftest import TINY_MODEL

LIBRARY = '''
import torch
TABLE = torch.linspace(-1, 1, 256)  # a library's map, made as it is imported (bitsandbytes makes one so)
'''


@pytest.mark.parametrize("device", [lambda: CpuDevice("64MiB"), lambda: FakeDevice("2GiB")], ids=["cpu", "fake"])
def test_a_library_imported_by_the_first_trial_is_not_counted_in_it(tmp_path, monkeypatch, write_model, device):
    """The model file imports a library in build_model (as PEFT imports bitsandbytes): the first trial leaves
    nothing behind and reads what the second reads; the library's table is a real tensor of host memory."""
    name = f"lib_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(LIBRARY)
    monkeypatch.syspath_prepend(str(tmp_path))
    source = TINY_MODEL.replace("def build_model():\n", f"def build_model():\n    import {name}  # noqa\n")
    mf = load_model_file(write_model(source))
    plan = Plan(2, 8, "fp32", global_batch_size=2)
    first, second = (run_trial(mf, plan, device()) for _ in range(2))
    assert name in sys.modules
    assert first.left_bytes == second.left_bytes == 0
    assert (first.peak_allocated_bytes, first.peak_bytes) == (second.peak_allocated_bytes, second.peak_bytes)
    table = sys.modules[name].TABLE
    assert type(table) is torch.Tensor and table.tolist()[-1] == 1.0  # (not a FakeTensor: it has its values)


def test_the_finder_is_in_place_only_inside_for_the_measuring_thread_and_leaves_modules_as_they_are(monkeypatch):
    """Inside, a new module's code runs through the wrapper (in this thread only: another thread's import is its
    own); after, the finder is gone and the module keeps its own loader."""
    import importlib
    import importlib.machinery
    import threading

    from oomtune.memory import imports

    ran: list[str] = []
    exec_module = imports._Outside.exec_module
    monkeypatch.setattr(imports._Outside, "exec_module", lambda self, m: (ran.append(m.__name__), exec_module(self, m)))
    for name in ("colorsys", "this"):
        monkeypatch.delitem(sys.modules, name, raising=False)  # (imported afresh here)
    with imports_outside(), imports_outside():
        assert sys.meta_path[0] is imports._FINDER and sys.meta_path.count(imports._FINDER) == 1
        importlib.import_module("colorsys")
        other = threading.Thread(target=importlib.import_module, args=("this",))  # (it prints the Zen: captured)
        other.start()
        other.join()
    assert ran == ["colorsys"] and "this" in sys.modules
    assert not any(type(f).__name__ == "_Finder" for f in sys.meta_path)
    loader = sys.modules["colorsys"].__loader__
    assert isinstance(loader, importlib.machinery.SourceFileLoader)
    assert sys.modules["colorsys"].__spec__.loader is loader
