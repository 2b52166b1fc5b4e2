"""The lives of a trial whose second step was made from its first (second_step.py), each with the breakdown's part
it belongs to (life_kinds.Kinds), without a Recorder having seen the second step. No torch here.

A made step's storages are the first step's born again: each life in it has the kind of the life it repeats (an
activation kept for backward, a gradient, a step's scratch: recorder.StorageRecord's tags and span, which the first
step's recording has), and the lives that outlive the first step go on into the second as they are. So the made
trace is walked storage by storage, each life given the first step's record it stands for (by where that record was
born in the tracker's events); the peak's parts are then read as for any traced trial (life_kinds.peak_parts).
Where a life's record cannot be told (a storage resized inside the made step, a record born outside the kept
events) the answer is None: the trial has no breakdown (the estimate's answer is then traced again with both steps
run)."""

from __future__ import annotations

from collections.abc import Callable

from .life_kinds import Kinds, life_kinds


def made_kinds(records: list, initial: list[tuple[object, int]], made: list[tuple], events: int,
               points: tuple[int, ...], kind_of: Callable[[object], str]) -> Kinds | None:
    """The Kinds of the made events. `records`: the Recorder's of the one-step trial; `initial`: (key, bytes) of
    the device storages alive when its events began; `made`: the events with the second step made
    (second_step.with_second_step) from the trial's `events` events, whose step began and returned at `points`
    (start, returned, end: the made step is put in at `end`); `kind_of(record)`: its part. None where a life's
    record cannot be told."""
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

    return life_kinds(made, initial, before, record_at, kind_of)
