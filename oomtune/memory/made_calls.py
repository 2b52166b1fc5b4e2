"""Calls on fake tensors made from the first of their kind instead of computed.

On the fake device a tensor holds no values, so a call that only computes (a chunk of the 8-bit AdamW's step,
torchao's NF4 dequantization of a weight, its quantization) computes nothing: all a trial measures of it is the
storages its ops make and free, in order, and what it returns. The first call of each kind (the caller says what a
kind is: the shapes and dtypes of what it is given) runs as on every device, watched: each storage an op makes (not a
view or an in-place write of one it was given), its size, dtype and device, where it is freed among the births, and
which of them the call returns (as what view). Each later call of that kind makes storages of the same sizes,
frees them in the same order and returns views of those it returned (made with `torch.empty`; the others counted
by the tracker with no tensor made), which the tracker counts (its budget, the allocator model, the trace, the
breakdown's recorder) as it counts the call's own ops; the tensors the call writes in place are marked as written
with unknown values (fakes.Values), as its ops would. A call that leaves alive a storage it does not return, or
returns one it did not make, is never made.

Real tensors (the cpu device, a GPU) are always computed, and so is every call of a memory snapshot's trial (it shows
each storage's op and frames): `fake_call` says where a call may be made.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode_stack

from . import tracker
from .fakes import current_values
from .tracker import _tensors, storage_key

Event = tuple  # ("b", index, nbytes, dtype, device) a birth; ("f", index) a free


@dataclass(frozen=True)
class Pattern:
    """What one call did to storages, in order, and what it returned: for each tensor returned (in the order the
    caller flattens them), (its storage's birth index, size, stride, storage offset)."""

    events: tuple[Event, ...]
    outputs: tuple[tuple, ...] = ()


class _Watch(TorchDispatchMode):
    """The storages the ops under it make, and their frees, in order."""

    def __init__(self):
        super().__init__()
        self.events: list[Event] = []
        self.alive: dict[int, int] = {}  # id(storage) -> its birth's index, while it lives
        self.births = 0
        self.on = True
        self.hosting = _hosting()
        self.sizes: dict[int, int] = {}  # birth index -> its bytes
        self.odd = False  # a storage resized in place, hosted otherwise than the call began, or with no plain storage

    def _died(self, key: int, index: int) -> None:
        self.alive.pop(key, None)
        if self.on:
            self.events.append(("f", index))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        try:
            given = {id(t.untyped_storage()) for t in _tensors((args, kwargs or {}))}
            made = [(t, t.untyped_storage()) for t in _tensors(out)]
        except (RuntimeError, NotImplementedError):  # (a tensor with no plain storage: never made)
            self.odd = True
            return out
        self.odd |= any(storage_key(t) is None for t, _ in made)  # (a wrapper subclass's, sparse: never made)
        for t, st in made:
            key = id(st)
            if key in self.alive:
                self.odd |= st.nbytes() != self.sizes[self.alive[key]]  # (resized in place)
            if key in given or key in self.alive:
                continue
            self.odd |= _hosting() != self.hosting
            index, self.births = self.births, self.births + 1
            self.alive[key] = index
            self.events.append(("b", index, st.nbytes(), t.dtype, t.device))
            self.sizes[index] = st.nbytes()
            weakref.finalize(st, self._died, key, index)
        return out


def _hosting() -> bool:
    """Whether the innermost tracker counts what is made now as the host's."""
    return bool(tracker._ACTIVE) and tracker._ACTIVE[-1]._hosting > 0


def fake_call(*tensors: torch.Tensor) -> tuple | None:
    """What a call's kind holds beyond its arguments' shapes, where it may be made: (whether the tracker counts what
    it makes as the host's, whether autograd records, whether autocast is on); None where it is computed (a tensor
    is real, or a memory snapshot's trial records each storage's op and frames)."""
    if not all(isinstance(t, FakeTensor) for t in tensors):
        return None
    active = tracker._ACTIVE[-1] if tracker._ACTIVE else None
    if active is not None and active.recorder is not None and active.recorder.stacks:
        return None
    return (_hosting(), torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
            torch.is_autocast_enabled("cuda"))


def watched(call: Callable[[], object], returned: Callable[[object], list[torch.Tensor]] = lambda out: []
            ) -> tuple[object, Pattern | None]:
    """(call(), its pattern): None where it cannot be made again (it left a storage alive that it does not return,
    returned a tensor on a storage it did not make or of another dtype than it was made with, made a size that is
    not a whole number of its dtype's items, resized a storage it made, made one hosted otherwise than the call
    began, or one with no plain storage). `returned(out)`: the tensors out holds, in a fixed order."""
    watch = _Watch()
    with watch:
        out = call()
    watch.on = False
    births = {e[1]: e for e in watch.events if e[0] == "b"}
    outputs = []
    for t in returned(out):
        index = watch.alive.get(id(t.untyped_storage()))
        if index is None or births[index][3] != t.dtype or births[index][2] != t.untyped_storage().nbytes():
            return out, None
        outputs.append((index, tuple(t.shape), t.stride(), t.storage_offset()))
    if (watch.odd or set(watch.alive.values()) != {o[0] for o in outputs}
            or any(e[2] % e[3].itemsize for e in births.values())):
        return out, None
    return out, Pattern(tuple(watch.events), tuple(outputs))


def made(pattern: Pattern, written: tuple[torch.Tensor, ...] = (), direct: bool = False) -> list[torch.Tensor]:
    """The call's storages made from its pattern, in order; the tensors it returned (views of those left alive).
    `written`: the tensors the call writes in place (their values, if any were known, are not after it). What it
    returns is made with `torch.empty` (`direct`: without an op, where each is its own storage: _direct); its
    scratch (born and freed inside) is counted by each tracker counting (MemoryTracker.count_made) with no tensor
    made, unless a call around it is being watched (which sees ops only)."""
    modes = _get_current_dispatch_mode_stack()
    watched_around = any(isinstance(m, _Watch) for m in modes)
    counting = [] if watched_around else [t for t in tracker._ACTIVE if not t._paused]
    returned = {o[0]: o for o in pattern.outputs}
    fake = None if not direct or watched_around or len(returned) != len(pattern.outputs) else \
        next((m for m in modes if isinstance(m, FakeTensorMode)), None)  # (each output its own birth: made direct)
    held: dict[int, object] = {}  # birth index -> its tensor, or the token its scratch is counted under
    try:
        for event in pattern.events:
            if event[0] == "b":
                _, index, nbytes, dtype, device = event
                if counting and index not in returned:
                    held[index] = token = object()
                    for t in counting:
                        t.count_made(id(token), nbytes)
                elif fake is not None:
                    held[index] = _direct(fake, nbytes, dtype, device, returned[index][1:], counting)
                else:
                    held[index] = torch.empty(nbytes // dtype.itemsize, dtype=dtype, device=device)
            else:
                _let_go(held.pop(event[1]), counting)
    except BaseException:
        for gone in held.values():
            _let_go(gone, counting)
        raise
    values = current_values()
    if values is not None:
        for t in written:
            values._mark_stale(t)
    if fake is not None:
        return [held[o[0]] for o in pattern.outputs]
    return [held[index].as_strided(size, stride, offset) for index, size, stride, offset in pattern.outputs]


def _direct(fake: FakeTensorMode, nbytes: int, dtype: torch.dtype, device: torch.device, view: tuple,
            counting: list) -> torch.Tensor:
    """A returned storage made as `torch.empty` and the view of it would make it, without an op through the modes
    (two ops through every mode cost about as much as the call they stand for): the fake tensor made from a meta
    one, counted by each tracker as an op's output is. Its values are unknown, as an empty's are."""
    size, stride, offset = view
    with _disable_current_modes():
        meta = torch.empty(nbytes // dtype.itemsize, dtype=dtype, device="meta").as_strided(size, stride, offset)
    out = FakeTensor(fake, meta, device)
    for t in counting:
        t.count_made_tensor(out)
    return out


def _let_go(gone: object, counting: list) -> None:
    """A made storage freed: a tensor's dies with it; a token's is released by the trackers that counted it."""
    if not isinstance(gone, torch.Tensor):
        for t in counting:
            if t.follow:  # (a one-off count never sees a death)
                t._release(id(gone))


class MadeCalls:
    """The patterns of one kind of call (kind -> Pattern), and how many calls were made from them."""

    def __init__(self, direct: bool = False):
        self.patterns: dict[tuple, Pattern | None] = {}  # None: that kind's first call could not be made again
        self.made = 0
        self.direct = direct  # what a call returns made without an op (_direct): the optimizer's state

    def __call__(self, kind: tuple | None, call: Callable[[], object],
                 returned: Callable[[object], list[torch.Tensor]] = lambda out: [],
                 rebuilt: Callable[[list[torch.Tensor]], object] = lambda tensors: None,
                 written: tuple[torch.Tensor, ...] = ()) -> object:
        """call() where `kind` is None or not seen yet (watched, for the next of its kind), else the call made from
        its kind's pattern: rebuilt(the tensors it returned)."""
        if kind is None:
            return call()
        if kind in self.patterns:
            pattern = self.patterns[kind]
            if pattern is not None:
                self.made += 1
                return rebuilt(made(pattern, written, self.direct))
            return call()
        out, self.patterns[kind] = watched(call, returned)
        return out
