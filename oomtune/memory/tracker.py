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

import contextlib
import os
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from ..errors import OomtuneError
from ..units import format_bytes
from .allocator import OutOfMemory, rounded

if TYPE_CHECKING:
    from .recorder import Recorder

# ops that read a tensor's metadata and make none; wrapper subclasses (NF4) dispatch `.device` for every use
METADATA_OPS = frozenset(getattr(torch.ops.prim, name).default for name in ("device", "layout")
                         if hasattr(torch.ops.prim, name))
# a fake tensor's `.device`, which the autograd engine and the optimizers ask for every tensor they touch: two in
# three of the ops a fake trial dispatches (tiny_gpt). The tracker, outermost, answers it as FakeTensor does.
_PRIM_DEVICE = torch.ops.prim.device.default

# the autograd node running now (None outside the backward pass); without it, recomputation is not told apart
_current_autograd_node = getattr(torch._C, "_current_autograd_node", lambda: None)


_ACTIVE: list[MemoryTracker] = []  # trackers inside their `with` block, told about storage resizes
_RESIZE = torch.UntypedStorage.resize_


def _tracked_resize(storage: torch.UntypedStorage, size: int):
    """UntypedStorage.resize_ while a tracker is active. FSDP frees and re-allocates an unsharded parameter by
    resizing its storage in place (to 0 and back), which never reaches the dispatcher: the trackers are told
    here, and one over its budget refuses to grow the storage, as the CUDA allocator would. Not those paused for a
    storage they do not count (untracked(): a storage made there is none of theirs)."""
    key = id(storage)  # (paused: a storage it counts already still changes size)
    counting = [t for t in _ACTIVE if not t._paused or key in t._sizes or key in t._host_sizes]
    for tracker in counting:
        tracker._check_resize(storage, size)
    out = _RESIZE(storage, size)
    for tracker in counting:
        tracker._account_storage(storage)
    return out


@contextlib.contextmanager
def untracked() -> Iterator[None]:
    """The active trackers count nothing made inside: values computed a way the device being simulated would not
    (memory/cuda_attention.py), whose tensors are then `adopted` at the sizes that device's kernel allocates."""
    paused = list(_ACTIVE)
    for tracker in paused:
        tracker._paused += 1
    try:
        yield
    finally:
        for tracker in paused:
            tracker._paused -= 1


def adopt(*tensors) -> None:
    """Count tensors made inside `untracked()` from now on, in every active tracker (an OOM where they pass one's
    budget)."""
    for tracker in list(_ACTIVE):
        added = tracker.track(*tensors)
        tracker._check_budget(added)


def storage_key(t) -> int | None:
    """The key the tracker counts `t`'s storage under (None for what it does not count so)."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or is_traceable_wrapper_subclass(t):
        return None
    return id(t.untyped_storage())


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


def simulated_oom_message(tried: int, budget: int, in_use: int, kind: str, why: str = "") -> str:
    """CUDA's wording, so code that recognises a CUDA OOM by its message (Lightning, Accelerate) does."""
    free = max(0, budget - in_use)
    return (
        f"CUDA out of memory. Tried to allocate {format_bytes(tried)}. GPU 0 has a total capacity of "
        f"{format_bytes(budget)} of which {format_bytes(free)} is free. Of the allocated memory "
        f"{format_bytes(in_use)} is allocated by PyTorch.{why} (Simulated by oomtune's {kind} device.)"
    )


def system_memory() -> tuple[int, int]:
    """(total, available) bytes of host RAM."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = total
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    return total, available


class MemoryTracker(TorchDispatchMode):
    """Live and peak bytes of tensor storages, with an optional budget that raises a CUDA-shaped OOM."""

    def __init__(self, budget_bytes: int | None = None, kind: str = "cpu", *, follow: bool = True):
        """`follow=False`: a one-off count (`track` once, read `live_bytes`): storages are not watched for their
        death, so nothing of this tracker outlives the tensors' count."""
        super().__init__()
        self.budget_bytes = budget_bytes
        self.kind = kind
        self.follow = follow
        self.live_bytes = 0
        self.peak_bytes = 0
        self._sizes: dict[int, int] = {}  # id(storage) -> counted bytes; an entry leaves when the storage dies
        self.recorder: Recorder | None = None  # records each storage's life (recorder.py): a breakdown of the peak
        # host memory (the offload levers): storages born inside `hosting()`, counted apart, never in the budget
        self.host_live_bytes = 0
        self.host_peak_bytes = 0
        self.host_budget_bytes: int | None = None  # the machine's RAM, where the host can run out
        # computed tensors (cpu, and fake computing instead) are real: past this much, the machine itself runs out
        self.ram_limit_bytes: int | None = None
        self._host_sizes: dict[int, int] = {}
        self._hosting = 0
        self.allocator = None  # a CachingAllocatorModel fed every device storage's birth and death, where set
        self._paused = 0  # inside untracked(): ops run uncounted
        # where set, what runs each op beneath the tracker in place of the op itself: (func, types, args, kwargs) ->
        # its outputs (the fake device's Values: one Python mode fewer for each op; fakes.real_code_paths)
        self.inner: Callable | None = None
        # where set, what the device's storages did, in order (replay.py): ("set", key, bytes before rounding) for
        # a birth or a resize, ("free", key), ("mark", phase) from the device, ("host", key, bytes) and ("hfree", key)
        # for a host storage
        self.events: list[tuple] | None = None
        self._raw: dict[int, int] = {}  # id(storage) -> its bytes before rounding, while events are recorded

    @contextlib.contextmanager
    def hosting(self) -> Iterator[None]:
        """Storages born inside live in host memory (an offloaded optimizer state, saved activations moved off
        the device): counted in host_live_bytes, not against the device's budget."""
        self._hosting += 1
        try:
            yield
        finally:
            self._hosting -= 1

    def reset_host_peak(self) -> None:
        self.host_peak_bytes = self.host_live_bytes

    # -- accounting -------------------------------------------------------------------------------
    def _count(self, t: torch.Tensor) -> int:
        """Count t's storage once; return the bytes newly counted (0 if it was already known)."""
        if is_traceable_wrapper_subclass(t):  # a DTensor (FSDP's sharded parameter): count its local tensor(s)
            names, _ = t.__tensor_flatten__()
            inner = (getattr(t, name) for name in names)
            return sum(self._count(x) for x in inner if isinstance(x, torch.Tensor))
        if t.layout != torch.strided:  # sparse / nested: no plain storage to key on
            return 0
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # wrapper subclasses without storage
            return 0
        return self._account_storage(st)

    def _account_storage(self, st: torch.UntypedStorage | None, key: int | None = None, raw: int = 0) -> int:
        """Count `st` at its current size (new, or resized in place); return the bytes newly counted. `st` None: a
        storage no tensor holds, of `raw` bytes under `key` (made_calls.py), which the caller releases."""
        key, raw = (id(st), st.nbytes()) if st is not None else (key, raw)
        size = rounded(raw)
        if key in self._host_sizes or (self._hosting and key not in self._sizes):  # (a view of a device tensor: not)
            return self._account_host(st, key, size, raw)
        old = self._sizes.get(key)
        if old is None:
            self._sizes[key] = size
            if self.follow and st is not None:
                weakref.finalize(st, self._release, key)
        elif old != size:  # resize_ / set_ grew or shrank it in place
            self._sizes[key] = size
        else:
            if self.events is not None and self._raw.get(key, raw) != raw:  # resized within its rounding: a replay
                self._raw[key] = raw  # at another micro-batch may cross it
                self.events.append(("set", key, raw))
            return 0
        if self.events is not None:
            self._raw[key] = raw
            self.events.append(("set", key, raw))
        if self.recorder is not None:  # a resize is the old size dying and the new one being born
            tags = set()
            if old is not None:
                tags = self.recorder._live[key].tags if key in self.recorder._live else tags
                self.recorder.died(key)
            self.recorder.born(key, size)
            self.recorder._live[key].tags |= tags
        delta = size - (old or 0)
        self.live_bytes += delta
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        if self.allocator is not None:  # last: the counts above stand whether or not the model can serve it
            self._allocate(key, size, delta)
        return max(delta, 0)

    def _allocate(self, key: int, size: int, delta: int) -> None:
        """Feed the allocator model (new: a block taken; resized: the new one, then the old one freed); where its
        capacity cannot hold the block, the CUDA-shaped OOM (the storage dies with the failed op and is freed)."""
        try:
            self.allocator.resize(key, size)
        except OutOfMemory as e:
            raise torch.cuda.OutOfMemoryError(simulated_oom_message(
                size, self.allocator.capacity_bytes, self.allocator.reserved_bytes, self.kind,
                f" The caching allocator (as modelled) {e}.")) from None

    def _account_host(self, st: torch.UntypedStorage | None, key: int, size: int, raw: int) -> int:
        old = self._host_sizes.get(key)
        if self.events is not None and (old != size or self._raw.get(key, raw) != raw):
            self.events.append(("host", key, raw))
        self._raw[key] = raw
        if old is None and self.follow and st is not None:
            weakref.finalize(st, self._release, key)
        self._host_sizes[key] = size
        self.host_live_bytes += size - (old or 0)
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_live_bytes)
        if self.host_budget_bytes is not None and self.host_live_bytes > self.host_budget_bytes:
            raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory: the offloaded tensors need "
                               f"{format_bytes(self.host_live_bytes)} of host RAM and "
                               f"{format_bytes(self.host_budget_bytes)} is available (simulated by oomtune)")
        return 0

    def _check_resize(self, st: torch.UntypedStorage, size: int) -> None:
        if self.budget_bytes is None:
            return
        grow = rounded(size) - self._sizes.get(id(st), 0)
        if grow > 0 and self.live_bytes + grow > self.budget_bytes:
            raise torch.cuda.OutOfMemoryError(simulated_oom_message(grow, self.budget_bytes, self.live_bytes,
                                                                    self.kind))

    def __enter__(self):
        if not _ACTIVE:
            torch.UntypedStorage.resize_ = _tracked_resize
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        if not _ACTIVE:
            torch.UntypedStorage.resize_ = _RESIZE
        return super().__exit__(*exc)

    def _release(self, key: int) -> None:
        if self.events is not None and (key in self._sizes or key in self._host_sizes):
            self.events.append(("free" if key in self._sizes else "hfree", key))
        self._raw.pop(key, None)
        self.host_live_bytes -= self._host_sizes.pop(key, 0)
        self.live_bytes -= self._sizes.pop(key, 0)
        if self.allocator is not None:
            self.allocator.free(key)
        if self.recorder is not None:
            self.recorder.died(key)

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
                with self.hosting() if getattr(obj, "host_resident", False) else contextlib.nullcontext():
                    for state in obj.state.values():
                        for t in _tensors(state):
                            added += self._count(t)
            else:
                for t in _tensors(obj):
                    added += self._count(t)
        return added

    def count_made(self, key: int, raw: int) -> None:
        """A storage of `raw` bytes that no tensor holds, counted under `key` as an op's output is (the recorder,
        the allocator model, the budget): a call's scratch made from its pattern (made_calls.py), which frees it
        with `_release(key)`."""
        if self.recorder is not None:
            self.recorder.op = "empty"
        self._check_budget(self._account_storage(None, key, raw))

    def count_made_tensor(self, t: torch.Tensor) -> None:
        """A tensor made without an op (made_calls._direct), counted as an op's output is: the recorder, the
        allocator model, the budget."""
        if self.recorder is not None:
            self.recorder.op = "empty"
        self._check_budget(self._count(t))

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    # -- the hook every op runs through ----------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PRIM_DEVICE and type(args[0]) is FakeTensor and not args[0].fake_mode.in_kernel_invocation:
            return args[0].fake_device  # FakeTensor's own answer, without the modes beneath (see _PRIM_DEVICE)
        out = func(*args, **(kwargs or {})) if self.inner is None else self.inner(func, types, args, kwargs)
        if func in METADATA_OPS or self._paused:  # no tensor made, or none to count
            return out
        if self.recorder is not None:
            self.recorder.op = func.__name__
        added = 0
        for t in _tensors(out):
            added += self._count(t)
        if self.recorder is not None and self.recorder.on_op is not None:
            self.recorder.on_op(self.recorder, func, args, out)
        self._check_budget(added)  # `out` is dropped with this frame: the op's outputs are freed as the error unwinds
        return out

    def _check_budget(self, added: int) -> None:
        """The CUDA-shaped OOM where the bytes just counted took the live total past the budget; where they took it
        past the machine's RAM first (a budget larger than the RAM), one line to say so: not the card's OOM."""
        if added and self.ram_limit_bytes is not None and self.live_bytes > self.ram_limit_bytes:
            raise OomtuneError(f"the {self.kind} device's tensors are real and in this machine's RAM: they reached "
                               f"{format_bytes(self.live_bytes)}, most of the RAM that was free, before the budget "
                               f"({format_bytes(self.budget_bytes)}): give a --budget of at most "
                               f"{format_bytes(self.ram_limit_bytes)}, or run `oomtune probe` on the GPU")
        if added and self.budget_bytes is not None and self.live_bytes > self.budget_bytes:
            raise torch.cuda.OutOfMemoryError(
                simulated_oom_message(added, self.budget_bytes, self.live_bytes - added, self.kind))

    def limit_to_ram(self, computes: bool) -> None:
        """Where the tensors are real (`computes`) and the budget is more than the RAM free now (with what this
        tracker counts already, which is in use): stop at 90% of that (_check_budget), before the machine swaps or
        its OOM killer ends the process."""
        self.ram_limit_bytes = None
        if computes and self.budget_bytes is not None:
            limit = self.live_bytes + int(system_memory()[1] * 0.9)
            self.ram_limit_bytes = limit if self.budget_bytes > limit else None
