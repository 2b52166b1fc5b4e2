"""What was live at the peak of a trial whose second step was made from its first (second_step.py), sorted into the
breakdown's parts, without a Recorder having seen the second step. No torch here.

A made step's storages are the first step's born again: each life in it has the kind of the life it repeats (an
activation kept for backward, a gradient, a step's scratch: recorder.StorageRecord's tags and span, which the first
step's recording has), and the lives that outlive the first step go on into the second as they are. So the made
trace is walked storage by storage, each life given the first step's record it stands for (by where that record was
born in the tracker's events), the tensor peak found as a Recorder finds it (the first time live bytes are highest),
and the lives at it summed by kind. Where a life's record cannot be told (a storage resized inside the made step,
a record born outside the kept events) the answer is None: the trial has no breakdown (the estimate's answer is
then traced again with both steps run)."""

from __future__ import annotations

from collections.abc import Callable

from .allocator import rounded

Made = tuple[dict[str, int], str, int]  # (bytes per part, the phase at the peak, the tensor peak)


class _Unknown(Exception):
    pass


def _walk(made: list[tuple], initial: dict, record_at: Callable[[int, object], object], until: int | None):
    """Walk the made events' device storages: (the index of the first highest live total, that total, the phase
    there, the live lives {key: (bytes, record)} after event `until`)."""
    live = dict(initial)
    total = sum(size for size, _ in live.values())
    peak, peak_at, phase, peak_phase = total, -1, "setup", "setup"
    for e, ev in enumerate(made):
        kind = ev[0]
        if kind == "mark":
            phase = ev[1] if ev[1] is not None else phase
        elif kind == "set":
            size = rounded(ev[2])
            old = live.get(ev[1], (0, None))[0]
            if ev[1] in live and old == size:  # (a raw size within the same rounding: no new life)
                continue
            record = record_at(e, ev[1])
            if record is None or record.nbytes != size:
                raise _Unknown
            live[ev[1]] = (size, record)
            total += size - old
            if total > peak:
                peak, peak_at, peak_phase = total, e, phase
        elif kind == "free":
            if ev[1] not in live:
                raise _Unknown
            total -= live.pop(ev[1])[0]
        if e == until:
            return peak_at, peak, peak_phase, live
    return peak_at, peak, peak_phase, live


def made_peak(records: list, initial: list[tuple[object, int]], made: list[tuple], events: int,
              points: tuple[int, ...], kind_of: Callable[[object], str]) -> Made | None:
    """(bytes per part, the phase, the tensor peak) at the made trace's tensor peak. `records`: the Recorder's of
    the one-step trial; `initial`: (key, bytes) of the device storages alive when its events began; `made`: the
    events with the second step made (second_step.with_second_step) from the trial's `events` events, whose step
    began and returned at `points` (start, returned, end: the made step is put in at `end`); `kind_of(record)`: its
    part. None where a life's record cannot be told."""
    at = {r.at: r for r in records if r.at is not None}  # (a resize's died-and-born: the one born last)
    before = {r.key: r for r in records if r.at is None}  # the latest life of each key from before the events
    start, end = points[0], points[-1]
    added = len(made) - events  # events of the made step (from `end` on in `made`)

    def record_at(e: int, key: object):
        if e < end:
            return at.get(e)
        if e >= end + added:  # after the steps: the trial letting go
            return at.get(e - added)
        if isinstance(key, tuple) and key[0] == "2":  # a life the made step repeats: the first's, born there
            return at.get(start + key[1])
        return None  # (a storage from before the step resized in it)

    try:
        lives = {}
        for key, size in initial:
            record = before.get(key)
            if record is None or record.nbytes != rounded(size):
                return None
            lives[key] = (rounded(size), record)
        peak_at, peak, phase, _ = _walk(made, lives, record_at, None)
        _, _, _, live = _walk(made, lives, record_at, peak_at) if peak_at >= 0 else (0, 0, 0, lives)
    except _Unknown:
        return None
    parts: dict[str, int] = {}
    for size, record in live.values():
        parts[kind_of(record)] = parts.get(kind_of(record), 0) + size
    return parts, phase, peak
