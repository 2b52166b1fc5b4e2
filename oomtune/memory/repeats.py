"""A trace at N repeated blocks from traces at k, k+1 and k+2 of them, instead of traced. No torch here.

A model of N identical blocks (a transformer's layers) runs, in each phase of the step, the same events once per
block: a block's forward makes the same tensors, its backward frees them and makes the same gradients, a foreach
optimizer op makes one tensor per parameter, blocks' in a row. Between traces of the same plan with n and n+1
blocks, the trace with n+1 has, at each place where the blocks repeat, one more period of the same events; a few
sizes (a stack of one norm per parameter) grow by the same bytes a block; and a freed storage is found, counting
back from the event that frees it, a number of births earlier that is affine in n and in the period it is in.

`Template.fit` lines up three traces (k, k+1, k+2 blocks) that way; `Template.at(n)` makes the trace at any n. The
fit is accepted only where it reproduces all three traces event by event, each affine rule checked on more points
than it was fitted on; anything else (blocks that differ, an event that is not a line in n) is None, and the caller
traces the whole model instead. (How two traces line up: alignment.py.)

`Template.refit` makes the template of another plan of the same levers and context (another micro-batch) from its
traces at k and k+1 alone: the layout and storage rules are the fitted template's, each size's rule a line through
its two points, accepted only where it makes both traces event by event.
"""

from __future__ import annotations

from dataclasses import dataclass

from .alignment import SIZED, Run, Token, align, runs_of, token_key, tokens
from .life_kinds import Kinds
from .replay import Trace


def _layout(b: list[Token], runs: list[Run], k: int) -> list[tuple]:
    """The trace with k+1 blocks as segments: ("fixed", index in b) and ("run", run)."""
    out: list[tuple] = []
    j = 0
    for run in runs:
        out += [("fixed", x) for x in range(j, run.start)]
        out.append(("run", run))
        j = run.start + run.length * (k + 1 + run.offset)
    out += [("fixed", x) for x in range(j, len(b))]
    return out


def _positions(layout: list[tuple], n: int, k: int):
    """(slot, period) for each event of the trace at n blocks, in order; a slot is ("fixed", x) or (run, x)."""
    for seg in layout:
        if seg[0] == "fixed":
            yield seg, 0
            continue
        run = seg[1]
        for t in range(n + run.offset):
            for x in range(run.length):
                yield (run, x), t


def _solve(points: list[tuple[int, int, int]], checked: bool = True) -> tuple[int, int, int] | None:
    """Integer (c0, c1, c2) with v = c0 + c1 n + c2 t at every (n, t, v), fitted on some and checked on at least one
    more (`checked` False: or on none more, where a rule of the same form was checked elsewhere: Template.refit);
    None where the points do not determine it or it misses one."""
    ns = sorted({p[0] for p in points})
    if len(ns) < 2:
        return None
    by = {(n, t): v for n, t, v in points}
    n0, n1 = ns[0], ns[1]
    ts0 = sorted(t for n, t in by if n == n0)
    ts1 = sorted(t for n, t in by if n == n1)
    if not ts0 or not ts1:
        return None
    t0 = ts0[0]
    if (n1, t0) not in by:
        return None
    c1 = by[(n1, t0)] - by[(n0, t0)]
    c2 = 0
    if len(ts1) > 1:
        c2 = by[(n1, ts1[1])] - by[(n1, ts1[0])]
        if ts1[1] - ts1[0] != 1:
            return None
    c0 = by[(n0, t0)] - c1 * n0 - c2 * t0
    if checked and (len(points) < 4 and len(ts1) > 1 or len(points) < 3):
        return None  # fitted on all it has: nothing checks it
    if any(c0 + c1 * n + c2 * t != v for n, t, v in points):
        return None
    return c0, c1, c2


def without_last_frees(trace: Trace) -> Trace:
    """The trace less the frees after its last birth or resize (the end of a trial letting go of its model and
    state): they raise no peak and come before no allocation, so every reading replayed from it is the same, and
    their order (by birth, across all the blocks' tensors at once) is the one part of a trace that does not repeat
    block by block."""
    last = max((x for x, ev in enumerate(trace.events) if ev[0] in ("set", "hset")), default=-1)
    events = trace.events[:last + 1] + tuple(ev for ev in trace.events[last + 1:] if ev[0] not in ("free", "hfree"))
    return Trace(trace.initial, events, trace.host_initial)


@dataclass(frozen=True)
class Template:
    """Traces at any number of blocks: the layout of fixed events and runs, and each slot's rules."""

    initial: tuple[int, ...]
    layout: tuple[tuple, ...]
    k: int  # blocks in the first of the three fitted traces
    rules: dict  # slot -> (kind, value or (c0, c1, c2) for the raw bytes, ref rule or None)
    host_initial: tuple[int, ...] = ()

    @staticmethod
    def fit(traces: list[Trace], k: int) -> Template | None:
        """From the traces at k, k+1, k+2 (and more) blocks; None where they are not repeated blocks (module doc).
        A fourth trace gives the rules of runs whose first or last period differs more points to be checked on."""
        traces = [without_last_frees(t) for t in traces]
        if len({(t.initial, t.host_initial) for t in traces}) != 1 or len(traces) < 3:
            return None
        toks = [tokens(t) for t in traces]
        seen = [(k + i, t) for i, t in enumerate(toks)]
        ops = align(toks[0], toks[1])
        runs = runs_of(toks[1], ops, k) if ops is not None else None
        rules, layout = _tried(toks[1], runs, k, seen) if runs else (None, ())
        if rules is None:
            return None
        template = Template(traces[0].initial, layout, k, rules, traces[0].host_initial)
        return None if any(template.at(k + i) != trace for i, trace in enumerate(traces)) else template

    def refit(self, traces: list[Trace]) -> Template | None:
        """The template of another plan with the same levers and context (another micro-batch), from its traces at
        k and k+1 blocks: this one's layout and storage rules, each size's rule fitted anew on them (a line through
        two points in the blocks, where this template's were checked on three: the blocks of a model repeat alike at
        every micro-batch), accepted only where it makes both traces event by event; else None (the caller traces
        k+2 and fits as ever). A size that is the same in every block keeps to that, on every point (checked); one
        that grows with the blocks or the periods keeps to growing (a line through two points): where its form
        changes, the layout is not this micro-batch's (a tiny GPT's checkpointed 8-bit offload rung: its last
        block's activations differ at micro-batch 16 and not at 1), and None."""
        traces = [without_last_frees(t) for t in traces]
        if len(traces) < 2 or any(len(t.initial) != len(self.initial) or len(t.host_initial) !=
                                  len(self.host_initial) or (t.initial, t.host_initial) !=
                                  (traces[0].initial, traces[0].host_initial) for t in traces):
            return None
        values: dict = {}
        for i, trace in enumerate(traces):
            toks = tokens(trace)
            positions = list(_positions(self.layout, self.k + i, self.k))
            if len(positions) != len(toks):
                return None
            for (slot, t), (kind, value, _) in zip(positions, toks, strict=True):
                if kind in SIZED:
                    values.setdefault(slot, []).append((self.k + i, t, value))
        rules = {}
        for slot, (kind, value, ref) in self.rules.items():
            if kind in SIZED:
                fitted, value = value, _solve(values.get(slot, []), checked=False)
                if value is None or any((a == 0) != (b == 0) for a, b in zip(value[1:], fitted[1:], strict=True)):
                    return None  # a size the same in every block there and not here (or the other way): a period
                    # that differs at this micro-batch alone (the last block's, at 16 and not at 1), which two block
                    # counts would take for a line
            rules[slot] = (kind, value, ref)
        made = Template(traces[0].initial, self.layout, self.k, rules, traces[0].host_initial)
        return made if all(made.at(self.k + i) == trace for i, trace in enumerate(traces)) else None

    def at(self, n: int) -> Trace | None:
        """The trace at n blocks, less its last frees (without_last_frees); None where a rule gives a storage that
        does not exist or a negative size."""
        events: list[tuple] = []
        first = len(self.initial) + len(self.host_initial)
        born = first
        on_host = [False] * len(self.initial) + [True] * len(self.host_initial)  # each storage's memory, by number
        for slot, t in _positions(self.layout, n, self.k):
            kind, value, ref = self.rules[slot]
            key = None
            if ref is not None:
                key = ref[1] if ref[0] == "i" else born - 1 - (ref[1][0] + ref[1][1] * n + ref[1][2] * t)
                if key < 0 or key >= born or on_host[key] != kind.isupper():  # (a device free of a host storage)
                    return None
            if kind in SIZED:
                raw = value[0] + value[1] * n + value[2] * t
                if raw < 0:
                    return None
                if kind in "bB":
                    key, born = born, born + 1
                    on_host.append(kind == "B")
                events.append(("set" if kind in "br" else "hset", key, raw))
            elif kind in "fF":
                events.append(("free" if kind == "f" else "hfree", key))
            else:
                events.append(("mark", value))
        live = set(range(born))
        for ev in events:
            if ev[0] in ("free", "hfree"):
                if ev[1] not in live:  # a storage freed twice
                    return None
                live.discard(ev[1])
        # numbered by birth as Trace.of numbers them, each run of frees in the order of the traces it was fitted on
        return Trace(self.initial, tuple(events), self.host_initial)

    def kinds_at(self, n: int, traces: list[Trace], kinds: list[Kinds]) -> Kinds | None:
        """The parts of the lives of the trace at n blocks (life_kinds.Kinds) from those of the traces it was
        fitted on (at k, k+1, ... blocks): each device set event takes the part its slot's events had there in
        the same place of their run (its first period, its last, one between, the only one: the last block's
        storage may be scratch where the others' are kept), which must be one; None where they differ or one was
        never seen."""
        by_slot: dict = {}
        for i, (trace, (first, sets)) in enumerate(zip(traces, kinds, strict=True)):
            if first != kinds[0][0]:
                return None
            part = iter(sets)
            for place, tok in zip(self._places(self.k + i), tokens(without_last_frees(trace)), strict=True):
                if tok[0] in "br":
                    kind = next(part, "")
                    if by_slot.setdefault(place, kind) != kind:
                        return None
            if next(part, None) is not None:
                return None
        made = tuple(by_slot.get(place, "") for place in self._places(n) if self.rules[place[0]][0] in "br")
        return (kinds[0][0], made) if "" not in made else None

    def _places(self, n: int):
        """(slot, "first" / "between" / "last" / "only": its period's place in its run) of each event at n
        blocks (a fixed event's: "only")."""
        for slot, t in _positions(self.layout, n, self.k):
            last = n + slot[0].offset - 1 if isinstance(slot[0], Run) else 0
            yield slot, ("only" if last == 0 else "first") if t == 0 else "last" if t == last else "between"


PEELS = ((), ("first",), ("last",), ("first", "last"))


def _tried(b: list[Token], runs: list[Run], k: int, seen: list) -> tuple[dict | None, tuple]:
    """The rules and layout of the first of the runs' ways (_variants) whose rules are affine: each run whose rules
    are not is laid out its next way; a run split in parts gives way to each part, tried on its own from there."""
    ways: dict = {}
    tried = dict.fromkeys(runs, 0)  # per run: the index of the way it is laid out in
    while True:
        laid = {run: ways.setdefault(run, _variants(run, b, k))[x] for run, x in tried.items()}
        layout = tuple(_layout(b, sorted((part for parts in laid.values() for part in parts),
                                         key=lambda part: part.start), k))
        rules, failed = _rules(layout, k, seen)
        if rules is not None:
            return rules, layout
        failed = {run for run, parts in laid.items() if failed & set(parts)}
        if not failed or any(tried[run] == len(ways[run]) - 1 for run in failed):
            return None, ()
        for run in failed:
            tried[run] += 1
            parts = ways[run][tried[run]]
            if len(parts) > 1:
                del tried[run]
                tried.update(dict.fromkeys(parts, 0))


def _variants(run: Run, b: list[Token], k: int) -> list[tuple[Run, ...]]:
    """The ways to lay out a run, in the order tried: whole, less its first and/or last period (PEELS); where its
    period is periodic, as runs of the shorter one side by side (a run of frees: each block's old pair, then each
    one's fresh pair; the extra block's two pairs are inserted together and look like one period of four)."""
    out = [(_peeled(run, which),) for which in PEELS]
    periods = k + 1 + run.offset
    for parts in range(2, run.length + 1):
        short = run.length // parts
        if run.length % parts or not all(token_key(b[run.start + x]) == token_key(b[run.start + x % short])
                                         for x in range(run.length)):
            continue
        out.append(tuple(Run(run.start + i * short * periods, short, run.offset) for i in range(parts)))
    return out


def _peeled(run: Run, which: tuple[str, ...]) -> Run:
    """The run less its first and/or last period (the layout then holds them as fixed events)."""
    if "first" in which:
        run = Run(run.start + run.length, run.length, run.offset - 1)
    if "last" in which:
        run = Run(run.start, run.length, run.offset - 1)
    return run


def _rules(layout: tuple, k: int, seen: list[tuple[int, list[Token]]]) -> tuple[dict | None, set[Run]]:
    """Each slot's kind, value rule and storage rule, from the tokens at three block counts; (None, the runs whose
    rules are not affine) where they do not fit (no runs: a trace does not fit the layout)."""
    kinds: dict = {}
    values: dict = {}
    refs: dict = {}
    for n, toks in seen:
        positions = list(_positions(layout, n, k))
        if len(positions) != len(toks):
            return None, set()
        for (slot, t), (kind, value, ref) in zip(positions, toks, strict=True):
            shape = (kind, value if kind == "m" else None)
            if kinds.setdefault(slot, shape) != shape:
                return None, set()
            if kind in SIZED:
                values.setdefault(slot, []).append((n, t, value))
            if ref is not None:
                known = refs.setdefault(slot, ref if ref[0] == "i" else [])
                if isinstance(known, list) != (ref[0] == "d") or (ref[0] == "i" and known != ref):
                    return None, set()
                if ref[0] == "d":
                    known.append((n, t, ref[1]))
    rules: dict = {}
    failed: set = set()
    for slot, (kind, fixed) in kinds.items():
        value = _solve(values[slot]) if kind in SIZED else fixed
        ref = refs.get(slot)
        if isinstance(ref, list):
            solved = _solve(ref)
            ref = ("d", solved) if solved is not None else None
            if ref is None:
                failed.add(slot[0])
        if kind in SIZED and value is None:
            failed.add(slot[0])
        rules[slot] = (kind, value, ref)
    if failed:
        return None, {run for run in failed if isinstance(run, Run)} or {None}
    return rules, set()
