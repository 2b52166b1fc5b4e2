"""A trial's memory at another context length, replayed from traced trials at other contexts instead of run. No
torch here.

replay.py replays other micro-batches from two traces, a storage's bytes being affine in the micro-batch. In the
context T a storage's bytes are a polynomial of degree at most two: T x hidden for a block's activations, T x T
for eager attention's scores and a causal mask, neither for the weights. Three traces at three contexts that line
up event by event (the same storages born and freed in the same order, only sizes differing) fix each size's
quadratic; a fourth must lie on every one of them before any is used (three points fit any values: the fourth is
the check). The trace at another context is then made from them, and replayed as a traced one would be.

A size may instead be a quadratic in the context rounded up to 32 or 128 (the log-sum-exp and backward scratch of
CUDA attention's kernels); each size keeps every quadratic the four pass through, and a context at which two of
them disagree is not made (four contexts that are all multiples of 128 cannot tell T from T rounded to 128: 200 is
then traced). Traces that do not line up (a kernel chosen by the length) or a size on no curve at the fourth
context: no curves, every context traced. Sizes between the checked contexts are interpolated, outside
them extrapolated; the estimate traces its answer again (search/estimate.py), so a curve wrong there shows."""

from __future__ import annotations

from dataclasses import dataclass, field

from .replay import Trace

FIT = 3  # contexts the quadratics are fitted on
CHECKED = FIT + 1  # ... and traced contexts needed before they are used (at least one checks them)
PADS = (1, 32, 128)  # a size may be a quadratic in the context rounded up to these (CUDA attention's kernels keep
# their log-sum-exp and backward scratch at T rounded to 32 or 128: cuda_attention.py)


def _padded(context: int, pad: int) -> int:
    return -(-context // pad) * pad


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
class _Quadratic:
    """The quadratic through (x0, v0), (x1, v1), (x2, v2), x = the context rounded up to `pad`, in Newton's form kept
    in whole numbers: v(x) = (v0 * D + e1 * b * c * (x - x0) + e2 * (x - x0) * (x - x1)) / D, with a = x1 - x0,
    b = x2 - x1, c = x2 - x0, D = a * b * c."""

    pad: int
    xs: tuple[int, int, int]
    v0: int
    e1: int
    e2: int

    @staticmethod
    def through(pad: int, contexts: list[int], values: list[int]) -> _Quadratic | None:
        xs = tuple(_padded(t, pad) for t in contexts[:FIT])
        if len(set(xs)) < FIT:
            return None
        (x0, x1, x2), (v0, v1, v2) = xs, values[:FIT]
        return _Quadratic(pad, xs, v0, v1 - v0, (v2 - v1) * (x1 - x0) - (v1 - v0) * (x2 - x1))

    def checked(self, contexts: list[int]) -> bool:
        """Do `contexts` check it: one of them rounds to a point it was not fitted on (512, 32, 256 and 128 rounded
        up to 128 are 512, 128, 256 and 128 again: no check)."""
        return any(_padded(t, self.pad) not in self.xs for t in contexts)

    def at(self, context: int) -> int | None:
        """The bytes at `context`; None where the quadratic gives no whole number there."""
        x0, x1, x2 = self.xs
        b, c = x2 - x1, x2 - x0
        x = _padded(context, self.pad)
        size, rest = divmod(self.v0 * (x1 - x0) * b * c + self.e1 * b * c * (x - x0) + self.e2 * (x - x0) * (x - x1),
                            (x1 - x0) * b * c)
        return size if not rest else None


@dataclass(frozen=True)
class Curves:
    """Traces at FIT contexts (and more that checked them) lined up: each set event's raw bytes at a context T as
    the quadratics (_Quadratic) in T, or in T rounded up to 32 or 128, that pass through all of them, a fourth
    context checking each (rounded, it is not one of the three it was fitted on); a context where two such
    quadratics of an event disagree is not made (which the traces cannot tell)."""

    template: Trace  # the trace at the first context (its events' kinds, storages and marks)
    terms: dict[int, tuple[_Quadratic, ...]] = field(repr=False)  # event index -> its quadratics, for the sets

    @staticmethod
    def through(points: list[tuple[int, Trace]]) -> Curves | None:
        """The curves through traces at CHECKED or more distinct contexts ((context, trace)), fitted on the first
        three and checked on the rest; None where they do not line up or a size is on no curve."""
        contexts = [t for t, _ in points]
        if len(set(contexts)) != len(contexts) or len(points) < CHECKED:
            return None
        traces = [trace for _, trace in points]
        if not _lined_up(traces):
            return None
        terms = {}
        for i, ev in enumerate(traces[0].events):
            if ev[0] not in ("set", "hset"):
                continue
            values = [trace.events[i][2] for trace in traces]
            fits = tuple(q for q in (_Quadratic.through(pad, contexts, values) for pad in PADS) if q is not None
                         and q.checked(contexts[FIT:])
                         and all(q.at(t) == v for t, v in zip(contexts[FIT:], values[FIT:], strict=True)))
            if not fits:
                return None
            terms[i] = fits
        return Curves(traces[0], terms)

    def at(self, context: int) -> Trace | None:
        """The trace at `context`; None where a size would not be a whole number of bytes, would be negative, or
        is not told (its quadratics disagree there)."""
        events = list(self.template.events)
        for i, quadratics in self.terms.items():
            sizes = {q.at(context) for q in quadratics}
            size = sizes.pop()
            if sizes or size is None or size < 0:
                return None
            ev = events[i]
            events[i] = (ev[0], ev[1], size)
        return Trace(self.template.initial, tuple(events), self.template.host_initial)
