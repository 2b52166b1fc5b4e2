"""The tagging side of the tracker (tracker.py): each storage's birth, death, phase, tags and, for the memory
snapshot, the Python frames that made it."""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .tracker import _current_autograd_node, _tensors

if TYPE_CHECKING:
    from .tracker import MemoryTracker


@dataclass
class StorageRecord:
    """One storage's life, as a Recorder saw it. Events are numbered births and deaths: the storage was
    live at event e when born <= e < died."""

    nbytes: int  # counted bytes (512-byte rounded)
    born: int
    phase: str  # the recorder's label when it was born (forward, backward, ...)
    span: int  # the stretch of same-kind work it was born in (see Recorder.span_kind)
    died: int | None = None
    tags: set[str] = field(default_factory=set)
    op: str = ""  # the op that made it ("" where a tensor was counted outside an op: a model built before)
    frames: tuple[tuple[str, int, str], ...] = ()  # (file, line, function), innermost first, where stacks were asked
    key: int | None = None  # the tracker's key of its storage
    at: int | None = None  # the index of its birth in the tracker's events, where they were kept (second steps made)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # oomtune/
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
_OURS_SKIPPED = tuple(_PACKAGE + p for p in ("memory" + os.sep, "dist" + os.sep, "model_file.py", "checkpointing.py",
                                           "files.py"))
_DRIVERS = tuple(_PACKAGE + p for p in ("search" + os.sep, "cli" + os.sep, "api.py", "train" + os.sep))
MAX_FRAMES = 16


def _skipped(name: str) -> bool:
    """torch's frames, the standard library's (not the packages installed beside it), the tracker's and the model
    file loader's wrappers."""
    return name.startswith((_TORCH, *_OURS_SKIPPED)) or (
        name.startswith(_STDLIB) and f"{os.sep}site-packages{os.sep}" not in name
        and f"{os.sep}dist-packages{os.sep}" not in name)


def python_frames() -> tuple[tuple[str, int, str], ...]:
    """The Python frames that led to an allocation, innermost first: the model file's lines (and those of the
    libraries it calls, transformers' say), the training step, the levers; up to the trial that runs them, not the
    command, script or test that ran the trial (oomtune's search, CLI and API, and whatever called those)."""
    out = []
    f = sys._getframe(1)
    while f is not None and len(out) < MAX_FRAMES:
        name = os.path.abspath(f.f_code.co_filename)
        if name.startswith(_DRIVERS):
            break
        if not _skipped(name):
            out.append((name, f.f_lineno, f.f_code.co_name))
        f = f.f_back
    return tuple(out)


class Recorder:
    """The tagging side of the tracker: every storage's birth, death, phase and tags, and the moment of the
    peak, so that what was live at the peak can be sorted into kinds afterwards (oomtune.estimate does).
    Attach with `tracker.recorder = Recorder(tracker)`; it costs a little per op, so only a breakdown runs it.

    Its peak is that of everything it saw (never reset by phases): the live set at `peak_event` sums to
    `peak_bytes` exactly."""

    def __init__(self, tracker: MemoryTracker):
        self.records: list[StorageRecord] = []
        self._live: dict[int, StorageRecord] = {}  # storage key -> its record while it lives
        self.event = 0
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_event = -1
        self.peak_phase = "setup"
        self.phase = "setup"
        self.span = 0
        self.span_kinds: list[str] = ["setup"]  # span -> its kind
        self.span_ends: list[int | None] = [None]  # span -> the event at which the next span began
        self.on_op: Callable[[Recorder, object, tuple, object], None] | None = None  # tags op outputs
        self.op = ""  # the op running now (the tracker says)
        self.stacks = False  # record each birth's Python frames (the memory snapshot; costs a stack walk a birth)
        self.made = None  # (parts, phase, peak) at the peak of a trial whose second step was made (made_peak.py)
        self.kinds = None  # that trial's lives' parts (life_kinds.Kinds), where they could be told
        self._tracker = None
        for key, size in list(tracker._sizes.items()):  # storages alive before recording began
            self.born(key, size)
            self._live[key].tags.add("preexisting")
        self._tracker = tracker  # (the births it tells from now on are its events' last, where it keeps them)

    def restarted(self, tracker: MemoryTracker) -> Recorder:
        """A new Recorder on `tracker` with this one's op hook: the run it recorded is discarded."""
        new = Recorder(tracker)
        new.on_op, new.stacks = self.on_op, self.stacks
        return new

    # -- what the tracker tells it ------------------------------------------------------------------
    def span_kind(self) -> str:
        """forward: the whole forward phase; recompute: grad-enabled work inside the autograd engine during
        backward (activation checkpointing re-running a block); otherwise the phase itself."""
        if self.phase == "backward" and torch.is_grad_enabled() and _current_autograd_node() is not None:
            return "recompute"
        return self.phase

    def born(self, key: int, nbytes: int) -> None:
        kind = self.span_kind()
        if kind != self.span_kinds[self.span]:
            self.span_ends[self.span] = self.event
            self.span += 1
            self.span_kinds.append(kind)
            self.span_ends.append(None)
        events = self._tracker.events if self._tracker is not None else None
        rec = StorageRecord(nbytes, self.event, self.phase, self.span, op=self.op,
                            frames=python_frames() if self.stacks else (), key=key,
                            at=len(events) - 1 if events else None)
        self.records.append(rec)
        self._live[key] = rec
        self.event += 1
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_event, self.peak_phase = self.live_bytes, rec.born, self.phase

    def died(self, key: int) -> None:
        rec = self._live.pop(key, None)
        if rec is not None:
            rec.died = self.event
            self.event += 1
            self.live_bytes -= rec.nbytes

    # -- what a caller tells it ---------------------------------------------------------------------
    def mark(self, phase: str) -> None:
        self.phase = phase

    def tag(self, tag: str, *objs) -> None:
        """Tag the live storages of tensors (or containers of them)."""
        for obj in objs:
            for t in _tensors(obj):
                for leaf in _leaves(t):
                    rec = self.record_of(leaf)
                    if rec is not None:
                        rec.tags.add(tag)

    def record_of(self, t: torch.Tensor) -> StorageRecord | None:
        if is_traceable_wrapper_subclass(t):  # a DTensor: its local shard
            local = getattr(t, "_local_tensor", None)
            return self.record_of(local) if isinstance(local, torch.Tensor) else None
        try:
            return self._live.get(id(t.untyped_storage()))
        except (RuntimeError, NotImplementedError):
            return None

    def live_at_peak(self) -> list[StorageRecord]:
        e = self.peak_event
        return [r for r in self.records if r.born <= e and (r.died is None or r.died > e)]

    def outlived_span(self, rec: StorageRecord) -> bool:
        """Was it still alive when the stretch of work that made it ended (kept for later, not scratch)?"""
        end = self.span_ends[rec.span]
        return end is None or rec.died is None or rec.died > end


def _leaves(t: torch.Tensor):
    """The tensors holding a tensor's storage: a wrapper subclass's inner ones (an NF4 weight's codes and scales,
    a DTensor's shard), else itself."""
    if not is_traceable_wrapper_subclass(t):
        yield t
        return
    names, _ = t.__tensor_flatten__()
    for name in names:
        inner = getattr(t, name, None)
        if isinstance(inner, torch.Tensor):
            yield from _leaves(inner)
