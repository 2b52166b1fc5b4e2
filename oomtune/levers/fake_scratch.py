"""The 8-bit AdamW's chunk scratch on fake tensors, made from the first chunk of its kind instead of computed.

On the fake device a tensor holds no values, so a chunk of BlockwiseAdamW8bit's step (dequantize both moments,
update, quantize them back: about 80 ops) computes nothing: all a trial measures of it is the storages its ops make
and free, in order. A 7B full fine-tune's step runs hundreds of such chunks, most of them alike, and they were two
thirds of its trial's time. So the first chunk of each kind (its rows, the parameter's and gradient's dtypes and
device, whether it is a slice of the parameter) runs as on every device, watched: each storage an op makes (not a
view or an in-place write of one it was given), its size, dtype and device, and where it is freed among the births.
Each later chunk of that kind makes storages of the same sizes with `torch.empty` and frees them in the same order,
one op each, which the tracker counts (its budget, the allocator model, the trace, the breakdown's recorder) as it
counts the chunk's own ops; the tensors the chunk writes are marked as written with unknown values (fakes.Values),
as its ops would. A kind whose chunk leaves a storage alive is never made. Real tensors (the cpu device, a GPU)
are always computed, and so is every chunk of a memory snapshot's trial (it shows each storage's op and frames).
tests/levers/test_fake_scratch.py holds a trial's trace equal, event for event, to every chunk run.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from ..memory import tracker
from ..memory.fakes import Values
from ..memory.tracker import _tensors

Pattern = list[tuple]  # ("b", index, nbytes, dtype, device) a birth; ("f", index) a free


class _Watch(TorchDispatchMode):
    """The storages the ops under it make, and their frees, in order."""

    def __init__(self):
        super().__init__()
        self.pattern: Pattern = []
        self.alive: dict[int, int] = {}  # id(storage) -> its birth's index, while it lives
        self.births = 0
        self.on = True

    def _died(self, key: int, index: int) -> None:
        self.alive.pop(key, None)
        if self.on:
            self.pattern.append(("f", index))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {id(t.untyped_storage()) for t in _tensors((args, kwargs or {}))}
        for t in _tensors(out):
            st = t.untyped_storage()
            key = id(st)
            if key in given or key in self.alive:
                continue
            index, self.births = self.births, self.births + 1
            self.alive[key] = index
            self.pattern.append(("b", index, st.nbytes(), t.dtype, t.device))
            weakref.finalize(st, self._died, key, index)
        return out


class FakeScratch:
    """Per optimizer: the chunk patterns seen (`kind` -> Pattern), and how many chunks were made from them."""

    def __init__(self):
        self.patterns: dict[tuple, Pattern] = {}
        self.made = 0

    @staticmethod
    def kind(p: torch.Tensor, rows: int, whole: bool) -> tuple | None:
        """The chunk's kind, or None where it is computed (real tensors; a memory snapshot's trial)."""
        if not isinstance(p, FakeTensor) or not isinstance(p.grad, FakeTensor):
            return None
        active = tracker._ACTIVE[-1] if tracker._ACTIVE else None
        if active is not None and active.recorder is not None and active.recorder.stacks:
            return None
        hosting = active is not None and active._hosting > 0  # (an offloaded step's storages are the host's)
        return rows, p.dtype, p.grad.dtype, p.device, whole, hosting

    def make(self, kind: tuple | None, written: tuple[torch.Tensor, ...] = ()) -> bool:
        """Make the chunk's storages from its kind's pattern (True), or not (False: it runs, watched). `written`:
        the tensors the chunk writes in place (their values, if any were known, are not after it)."""
        pattern = self.patterns.get(kind) if kind is not None else None
        if pattern is None:
            return False
        held: dict[int, torch.Tensor] = {}
        for event in pattern:
            if event[0] == "b":
                _, index, nbytes, dtype, device = event
                held[index] = torch.empty(nbytes // dtype.itemsize, dtype=dtype, device=device)
            else:
                del held[event[1]]
        for mode in _get_current_dispatch_mode_stack():
            if isinstance(mode, Values):
                for t in written:
                    mode._mark_stale(t)
        self.made += 1
        return True

    @contextlib.contextmanager
    def watching(self, kind: tuple | None) -> Iterator[None]:
        """Run the chunk; where it is fake, keep its pattern for the next of its kind (not where a storage it made
        outlives it, or a size is not a whole number of its dtype's items)."""
        if kind is None:
            yield
            return
        watch = _Watch()
        with watch:
            yield
        watch.on = False
        births = [e for e in watch.pattern if e[0] == "b"]
        if not watch.alive and all(e[2] % e[3].itemsize == 0 for e in births):
            self.patterns[kind] = watch.pattern
