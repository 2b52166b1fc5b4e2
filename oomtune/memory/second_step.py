"""A trial's second training step made from its first, not run. No torch here.

A trial runs two optimizer steps where a card's allocator model reads its peak: what the caching allocator reserves
in the second step depends on where the first left every block (its activations freed around the optimizer state the
first step made). On fake tensors the two steps cost the same Python, and the second repeats the first: the same
ops on the same sizes, less what only a first step makes. So the second step's events are made from the first's,
in the tracker's own terms (a storage's key, its raw bytes):

- every storage born in the first step is born again at the same place under a new key, and freed where it was,
  except those that outlive the step (the optimizer state, what a first forward caches): the second keeps them;
- the loss the trial holds (`loss_key`: it outlives the step too) is born again, and the first's is freed where the
  step returns (where the trial lets go of the last loss);
- a storage from before the step that the step freed is not freed again; what happens after the step (the trial
  letting go of everything) frees the second step's loss in place of the first's.

Where that rule does not hold (a model that makes other storages in its second step than in its first, or frees
what its first made: AdaLoRA's rank allocator) the made step differs from the run one: search/second_steps.py runs
both steps the first time it meets a plan and compares, to the event, and makes the step only where they agree.

`points`: indices into the events where each step starts, where its train_step returned, and (last) where the trial's
steps ended: (start_1, returned_1, start_2, returned_2, ..., end)."""

from __future__ import annotations

from .replay import Trace

BORN = ("set", "host")  # the tracker's raw events: ("set" | "host", key, raw bytes), ("free" | "hfree", key),
FREED = ("free", "hfree")  # ("mark", phase)


def _alive_at(events: list[tuple], initial: set, until: int) -> set:
    alive = set(initial)
    for ev in events[:until]:
        if ev[0] in BORN:
            alive.add(ev[1])
        elif ev[0] in FREED:
            alive.discard(ev[1])
    return alive


def _outliving(step: list[tuple], before: set) -> dict[int, bool]:
    """For each birth in `step` (by its index there) whether it outlives the step."""
    born: dict = {}  # key -> index of its birth in the step (the life now holding the key)
    outlives: dict[int, bool] = {}
    for i, ev in enumerate(step):
        kind = ev[0]
        if kind in BORN and ev[1] not in born and ev[1] not in before:
            born[ev[1]] = i
            outlives[i] = True
        elif kind in FREED:
            if ev[1] in born:
                outlives[born.pop(ev[1])] = False
            before.discard(ev[1])
    return outlives


def repeat_step(events: list[tuple], initial: set, start: int, returned: int, end: int,
                loss_key: int | None) -> tuple[list[tuple], dict]:
    """The events of a second step made from the first (events[start:end], its train_step returned at `returned`
    the loss stored under `loss_key`), with new keys ("2", index of the first's birth); and {first's key: second's
    key} for the loss, which the second makes again (the first's freed where the step returns)."""
    before = _alive_at(events, initial, start)
    step = events[start:end]
    outlives = _outliving(step, set(before))
    now: dict = {}  # the first step's key -> the second's, for the lives it makes again, while they live
    kept: set = set()  # keys of lives the second step does not make again (the optimizer state)
    again: dict = {}  # the first's key -> the second's, for the loss (which outlives the step)
    freed: list[tuple] = []  # the first loss's free, where the step returns (its kind: device or host)
    out: list[tuple] = []
    for i, ev in enumerate(step):
        if start + i == returned:
            out += freed
        kind, key = ev[0], ev[1] if len(ev) > 1 else None
        if kind == "mark":
            out.append(ev)
        elif kind in BORN and key in now:
            out.append((kind, now[key], ev[2]))
        elif kind in BORN and key in kept:
            continue
        elif kind in BORN and key not in before:
            if outlives[i] and key != loss_key:
                kept.add(key)
                continue
            now[key] = ("2", i)
            if outlives[i]:
                again[key] = now[key]
                freed = [("free" if kind == "set" else "hfree", key)]
            out.append((kind, now[key], ev[2]))
        elif kind in BORN:  # a storage from before the step resized: again
            out.append(ev)
        elif key in now:
            out.append((kind, now.pop(key)))
        else:  # a storage from before the step, freed by it: gone by the second
            before.discard(key)
    if returned >= end:
        out += freed
    return out, again


def with_second_step(events: list[tuple], initial: set, points: tuple[int, ...], loss_key: int | None) -> list[tuple]:
    """A one-step trial's events (points: start, returned, end) as the two-step trial's would be: the second step
    made from the first, then what came after the step, the first's loss read as the second's."""
    start, returned, end = points
    second, again = repeat_step(events, initial, start, returned, end, loss_key)
    after = []
    for ev in events[end:]:  # (a key the loss had may be another storage's once it is freed)
        if ev[0] != "mark" and ev[1] in again:
            after.append((ev[0], again[ev[1]], *ev[2:]))
            if ev[0] in FREED:
                del again[ev[1]]
        else:
            after.append(ev)
    return [*events[:end], *second, *after]


def second_step_agrees(events: list[tuple], initial: list, host_initial: list, points: tuple[int, ...],
                       loss_key: int | None) -> bool:
    """On a two-step trial's events (points: start_1, returned_1, start_2, returned_2, end; `loss_key`: where the
    first step's loss was): is its second step the one made from its first, event for event (storages numbered in
    order of birth, runs of frees in that order)?"""
    if len(points) != 5:
        return False
    start, returned, start_2, _, end = points
    keys = {k for k, _ in (*initial, *host_initial)}
    made, _ = repeat_step(events, keys, start, returned, start_2, loss_key)
    try:
        mine = Trace.of(initial, [*events[:start_2], *made], host_initial)
    except KeyError:  # the made step freed what the run one never had
        return False
    return mine == Trace.of(initial, events[:end], host_initial)
