"""A trial's memory at another context length, replayed from traced trials at other contexts instead of run. No
torch here.

replay.py replays other micro-batches from two traces, a storage's bytes being affine in the micro-batch. In the
context T a storage's bytes are a polynomial of degree at most two: T x hidden for a block's activations, T x T
for eager attention's scores and a causal mask, neither for the weights. Three traces at three contexts that line
up event by event (the same storages born and freed in the same order, only sizes differing) fix each size's
quadratic; a fourth must lie on every one of them before any is used (three points fit any values: the fourth is
the check). The trace at another context is then made from them, and replayed as a traced one would be.

Traces that do not line up (a kernel chosen by the length, a model that pads it) or a size off its curve at the
fourth context: no curves, every context traced. Sizes between the checked contexts are interpolated, outside
them extrapolated; the estimate traces its answer again (search/estimate.py), so a curve wrong there shows."""

from __future__ import annotations

from dataclasses import dataclass, field

from .replay import Trace

FIT = 3  # contexts the quadratics are fitted on
CHECKED = FIT + 1  # ... and traced contexts needed before they are used (at least one checks them)


def _lined_up(traces: list[Trace]) -> bool:
    """Every trace has the same storages, born and freed in the same order, at the same marks."""
    first = traces[0]
    for t in traces[1:]:
        if (t.initial, t.host_initial) != (first.initial, first.host_initial) or len(t.events) != len(first.events):
            return False
        for a, b in zip(first.events, t.events, strict=True):
            if a[0] != b[0] or a[1] != b[1]:
                return False
    return True


@dataclass(frozen=True)
class Curves:
    """Traces at FIT contexts (and more that checked them) lined up: each set event's raw bytes at a context T as
    (v0 * D + e1 * b * c * (T - T0) + e2 * (T - T0) * (T - T1)) / D, the quadratic through the three (Newton's
    form, kept in whole numbers: a = T1 - T0, b = T2 - T1, c = T2 - T0, D = a * b * c)."""

    template: Trace  # the trace at T0 (its events' kinds, storages and marks)
    contexts: tuple[int, int, int]  # T0, T1, T2
    terms: dict[int, tuple[int, int, int]] = field(repr=False)  # event index -> (v0, e1, e2), for the sets

    @staticmethod
    def through(points: list[tuple[int, Trace]]) -> Curves | None:
        """The curves through traces at CHECKED or more distinct contexts ((context, trace)), fitted on the first
        three and checked on the rest; None where they do not line up or a size is off its curve."""
        contexts = [t for t, _ in points]
        if len(set(contexts)) != len(contexts) or len(points) < CHECKED:
            return None
        traces = [trace for _, trace in points]
        if not _lined_up(traces):
            return None
        t0, t1, t2 = contexts[:FIT]
        a, b = t1 - t0, t2 - t1
        terms = {}
        for i, ev in enumerate(traces[0].events):
            if ev[0] not in ("set", "hset"):
                continue
            v0, v1, v2 = (trace.events[i][2] for trace in traces[:FIT])
            terms[i] = (v0, v1 - v0, (v2 - v1) * a - (v1 - v0) * b)
        curves = Curves(traces[0], (t0, t1, t2), terms)
        for context, trace in points[FIT:]:
            if any(curves._size(i, context) != trace.events[i][2] for i in terms):
                return None
        return curves

    def _size(self, i: int, context: int) -> int | None:
        """Event i's raw bytes at `context`; None where the quadratic gives no whole number of bytes there."""
        t0, t1, t2 = self.contexts
        a, b, c = t1 - t0, t2 - t1, t2 - t0
        d = a * b * c
        v0, e1, e2 = self.terms[i]
        num = v0 * d + e1 * b * c * (context - t0) + e2 * (context - t0) * (context - t1)
        size, rest = divmod(num, d)
        return size if not rest else None

    def at(self, context: int) -> Trace | None:
        """The trace at `context`; None where a size would not be a whole number of bytes or would be negative."""
        events = list(self.template.events)
        for i in self.terms:
            size = self._size(i, context)
            if size is None or size < 0:
                return None
            ev = events[i]
            events[i] = (ev[0], ev[1], size)
        return Trace(self.template.initial, tuple(events), self.template.host_initial)
