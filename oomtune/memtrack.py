"""The memory accountant behind the `cpu` and `fake` devices.

It counts the bytes of every live tensor storage, rounded up to 512 bytes as the CUDA caching
allocator rounds a block, and raises `torch.cuda.OutOfMemoryError` with CUDA's message shape when
the live total passes the budget. Every op runs through a TorchDispatchMode, so tensors made by
autograd, autocast and the optimizer are all seen; tensors that existed before (a model built
elsewhere) are added with `track()`.

Facts this relies on (PyTorch 2.4+): a storage keeps one Python object for its whole life, so it is
keyed by that object's identity (fake storages all report data_ptr 0); `weakref.finalize` on it fires
when the last tensor or view using it dies.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .units import format_bytes

BLOCK = 512  # the CUDA caching allocator's smallest rounding unit, bytes


def rounded(nbytes: int) -> int:
    return (nbytes + BLOCK - 1) // BLOCK * BLOCK


def _tensors(obj) -> Iterable[torch.Tensor]:
    """Tensors in an op's output: a tensor, or (nested) tuples/lists/dicts of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def simulated_oom_message(tried: int, budget: int, in_use: int, kind: str) -> str:
    """CUDA's wording, so code that recognises a CUDA OOM by its message (Lightning, Accelerate) does."""
    free = max(0, budget - in_use)
    return (
        f"CUDA out of memory. Tried to allocate {format_bytes(tried)}. GPU 0 has a total capacity of "
        f"{format_bytes(budget)} of which {format_bytes(free)} is free. Of the allocated memory "
        f"{format_bytes(in_use)} is allocated by PyTorch. (Simulated by oomtune's {kind} device.)"
    )


class MemoryTracker(TorchDispatchMode):
    """Live and peak bytes of tensor storages, with an optional budget that raises a CUDA-shaped OOM."""

    def __init__(self, budget_bytes: int | None = None, kind: str = "cpu"):
        super().__init__()
        self.budget_bytes = budget_bytes
        self.kind = kind
        self.live_bytes = 0
        self.peak_bytes = 0
        self._sizes: dict[int, int] = {}  # id(storage) -> counted bytes; an entry leaves when the storage dies

    # -- accounting -------------------------------------------------------------------------------
    def _count(self, t: torch.Tensor) -> int:
        """Count t's storage once; return the bytes newly counted (0 if it was already known)."""
        if t.layout != torch.strided:  # sparse / nested: no plain storage to key on
            return 0
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # wrapper subclasses without storage
            return 0
        key = id(st)
        size = rounded(st.nbytes())
        old = self._sizes.get(key)
        if old is None:
            self._sizes[key] = size
            weakref.finalize(st, self._release, key)
        elif old != size:  # resize_ / set_ grew or shrank it in place
            self._sizes[key] = size
        else:
            return 0
        delta = size - (old or 0)
        self.live_bytes += delta
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        return max(delta, 0)

    def _release(self, key: int) -> None:
        self.live_bytes -= self._sizes.pop(key, 0)

    def track(self, *objs) -> int:
        """Count tensors that were made outside the tracker: modules (params, grads, buffers),
        optimizers (state), tensors or containers of them. Returns the bytes newly counted."""
        added = 0
        for obj in objs:
            if isinstance(obj, torch.nn.Module):
                for p in obj.parameters():
                    added += self._count(p)
                    if p.grad is not None:
                        added += self._count(p.grad)
                for b in obj.buffers():
                    added += self._count(b)
            elif isinstance(obj, torch.optim.Optimizer):
                for state in obj.state.values():
                    for t in _tensors(state):
                        added += self._count(t)
            else:
                for t in _tensors(obj):
                    added += self._count(t)
        return added

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    # -- the hook every op runs through ----------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        added = 0
        for t in _tensors(out):
            added += self._count(t)
        if added and self.budget_bytes is not None and self.live_bytes > self.budget_bytes:
            in_use = self.live_bytes - added
            # `out` is dropped with this frame, so the op's outputs are freed as the error unwinds
            raise torch.cuda.OutOfMemoryError(
                simulated_oom_message(added, self.budget_bytes, in_use, self.kind)
            )
        return out
