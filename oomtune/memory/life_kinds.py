"""Each storage life of a traced trial with the part of the breakdown it belongs to, so that a trace made rather than
run (from fewer blocks: repeats.py, extrapolate.py) has the breakdown of its own peak, wherever that peak falls.
No torch here.

A trial's breakdown sorts what was live at its peak (breakdown.py: a Recorder's record per life, its tags and the
stretch of work it was born in). A traced trial's events are the same lives in order: each device `set` event that
begins a life (a new storage, or one resized past its rounding) is one record. Kinds keeps, beside the trace, each
initial storage's part and each device set event's part (None where the set begins no life: a raw size within the
same rounding). Three traces of k, k+1, k+2 blocks give each event of the trace at N blocks its part
(Template.kinds_at), and the walk below finds the peak the Recorder would have found (the first time the live
bytes are highest) and sums the lives at it by part."""

from __future__ import annotations

from collections.abc import Callable

from .allocator import rounded
from .replay import Trace

Kinds = tuple[tuple[str, ...], tuple[str | None, ...]]  # (each initial device storage's, each device set event's)
Parts = tuple[dict[str, int], str, int]  # (bytes per part, the phase at the peak, the tensor peak)


def life_kinds(events: list[tuple], initial: list[tuple[object, int]], before: dict,
               record_at: Callable[[int, object], object], kind_of: Callable[[object], str]) -> Kinds | None:
    """The Kinds of `events` (the tracker's, or a Trace's: storages keyed either way). `initial`: (key, bytes) of
    the device storages alive when they began; `before`: key -> the record of each such storage's life;
    `record_at(e, key)`: the record of the life event e begins; `kind_of(record)`: its part. None where a life's
    record cannot be told (none, or one of other bytes)."""
    sizes: dict = {}
    first = []
    for key, size in initial:
        record = before.get(key)
        if record is None or record.nbytes != rounded(size):
            return None
        sizes[key] = rounded(size)
        first.append(kind_of(record))
    out: list[str | None] = []
    for e, ev in enumerate(events):
        if ev[0] == "set":
            size = rounded(ev[2])
            if sizes.get(ev[1]) == size:  # (a raw size within the same rounding: no new life)
                out.append(None)
                continue
            record = record_at(e, ev[1])
            if record is None or record.nbytes != size:
                return None
            sizes[ev[1]] = size
            out.append(kind_of(record))
        elif ev[0] == "free" and sizes.pop(ev[1], None) is None:
            return None
    return tuple(first), tuple(out)


def run_kinds(trace: Trace, initial_keys: list, records: list, kind_of: Callable[[object], str]) -> Kinds | None:
    """The Kinds of a trial run as traced (no step made): the Recorder's `records` born during it, in the order of
    their births, are the trace's device set events that begin a life, in order; `initial_keys`: the tracker's
    keys of the trace's initial storages (TrackedDevice.traced_from)."""
    born = iter(sorted((r for r in records if r.at is not None), key=lambda r: r.at))
    before = {r.key: r for r in records if r.at is None}  # (the latest life of each key from before the events)
    kinds = life_kinds(list(trace.events), list(enumerate(trace.initial)),
                       {n: before.get(key) for n, key in enumerate(initial_keys)},
                       lambda e, key: next(born, None), kind_of)
    return kinds if next(born, None) is None else None  # (a record no event stood for: not these lives)


class _Misfit(Exception):
    pass


def _walk(trace: Trace, kinds: Kinds, until: int | None) -> tuple:
    """(the index of the first highest live total, that total, the phase there, the lives {n: (bytes, part)}
    after event `until`, or at the end)."""
    live = {n: (size, kind) for n, (size, kind) in enumerate(zip(trace.initial, kinds[0], strict=True))}
    total = sum(size for size, _ in live.values())
    peak, peak_at, phase, peak_phase = total, -1, "setup", "setup"
    sets = iter(kinds[1])
    for e, ev in enumerate(trace.events):
        if e == until:
            break
        if ev[0] == "mark":
            phase = ev[1] if ev[1] is not None else phase
        elif ev[0] == "set":
            size, kind = rounded(ev[2]), next(sets, "")
            old = live.get(ev[1], (0, None))[0]
            if (not kind) != (ev[1] in live and old == size) or kind == "":  # None: no new life, where the size
                raise _Misfit  # stays within its rounding, as the run saw it; "": no part left for it
            if kind is None:
                continue
            live[ev[1]] = (size, kind)
            total += size - old
            if total > peak:
                peak, peak_at, peak_phase = total, e, phase
        elif ev[0] == "free":
            if ev[1] not in live:
                raise _Misfit
            total -= live.pop(ev[1])[0]
    else:
        if next(sets, None) is not None:
            raise _Misfit
    return peak_at, peak, peak_phase, live


def peak_parts(trace: Trace, kinds: Kinds) -> Parts | None:
    """(bytes per part, the phase, the tensor peak) at `trace`'s first highest live total of device storages, as
    a Recorder that saw it would sort them; None where `kinds` does not fit the trace."""
    if len(kinds[0]) != len(trace.initial):
        return None
    try:
        peak_at, peak, phase, _ = _walk(trace, kinds, None)
        _, _, _, live = _walk(trace, kinds, peak_at + 1)  # (the lives just after the event that made the peak)
    except _Misfit:
        return None
    parts: dict[str, int] = {}
    for size, kind in live.values():
        parts[kind] = parts.get(kind, 0) + size
    return parts, phase, peak
