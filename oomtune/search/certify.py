"""The probe that starts from the estimate: certify each rung's predicted boundary on the device in two trials,
correct a miss from what the device measured, fall back to the search where the prediction is off. No torch here.

The estimate (the ladder on the fake device, in seconds and with no GPU) gives each rung a prior: its context
T_S, its micro-batch b_S, and the peaks it measured at T_S. The device then certifies the boundary:

- b_S fits and b_S + 1 does not (or b_S is the target batch): two trials;
- where T_S is below the target context, micro-batch 1 does not fit at the next context the search could pick:
  one more.

Where the rung will accumulate (the fit objective, b_S below the target B), what runs is the plan: micro-batch d,
the largest divisor of B that fits with B/d accumulation steps. Its boundary is certified instead, also in two
trials: d x B/d fits and d' x B/d' does not (d' the next divisor of B; B itself is the target, alone). That is the
rung's answer (RungResult.grad_accum_steps > 1) and the plan needs no trial of its own. The largest micro-batch
without accumulation (at least d; it may reach d' or more where only accumulation makes d' fail) is not tried
for: nothing runs it. A miss steps to the neighbouring divisor, up to MAX_CORRECTIONS + 1 steps; a rung not
certified by then is certified alone. Only where d is within a factor of two of the predicted b_S: further below
(B = 17 with 8 fitting: 1 x 17), the rung is certified alone too, so the probe can say why the plan runs below
what fits (divisor_note.py). On the rung the estimate chose (the one that note speaks of), a plan that stepped
down below the prediction (the estimate missed, or did not see what accumulation costs) is checked the same way on
the device: if 2d fits alone, the rung is certified alone too. Other rungs keep the plan they certified.

The fake device counts tensors exactly; its slope in the micro-batch is the device's. What it cannot see (the
allocator's rounding, workspaces, a CUDA context it assumes) shifts the device's peaks by roughly a constant and a
small proportion. So where the device's peak at the predicted size misses the limit the other way, the prediction is
corrected: the device's offset from the fake peak is measured at each size it ran (one point: a constant; two: a
line through the offsets), and the next size is the largest whose fake peak plus that offset stays under the limit.

A prior off by more than FALLBACK_ERROR at the first size the device ran, or one that has not certified its rung
after MAX_CORRECTIONS corrections, is not describing this device's memory (another kernel, a compiled model, a
different card): the rung falls back to the search (ladder.py), which reuses every trial already run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .ladder import (
    LadderResult,
    LadderSearch,
    Measurement,
    Objective,
    Point,
    Rung,
    RungResult,
    Trial,
    context_candidates,
    largest_divisor_at_most,
)

# The bound on the prior's first miss: the fake device's tensors are exact, and with the card's profile its
# allocator model and fixed costs are close; 25% off means a different shape of memory, not a shifted one. The
# bench's hidden overheads (a fixed part plus 5-10%) stay well under it; an overhead of 50% of the peak falls back.
FALLBACK_ERROR = 0.25
MAX_CORRECTIONS = 2


@dataclass(frozen=True)
class RungPrior:
    """What the estimate found for one rung."""

    context_length: int | None  # T_S (None: micro-batch 1 ran out even at the shortest context allowed)
    micro_batch_size: int | None  # b_S
    peaks: tuple[tuple[int, int], ...] = ()  # (micro-batch, peak that grows with it) measured at T_S, by size
    plan_micro_batch: int | None = None  # d: the plan's micro-batch with accumulation, where the estimate chose it
    chosen: bool = False  # the rung the estimate chose (the one whose plan the probe's divisor note speaks of)

    def peak_at(self, b: int) -> float | None:
        """The fake peak at `b`: the measured one, else the line through the nearest measured neighbours (the end
        segments extended). None with fewer than two sizes measured."""
        pts = sorted(self.peaks)
        if len(pts) < 2:
            return next((float(p) for s, p in pts if s == b), None)
        i = 1
        while i < len(pts) - 1 and pts[i][0] < b:
            i += 1
        (b0, p0), (b1, p1) = pts[i - 1], pts[i]
        return p0 + (p1 - p0) * (b - b0) / (b1 - b0)


def priors_from(ladder: LadderResult) -> dict[Rung, RungPrior]:
    """Each rung the estimate searched, as a prior (the chosen rung's with the plan's micro-batch it verified)."""
    out = {}
    c = ladder.choice
    for r in ladder.rungs:
        peaks = {t.point.micro_batch_size: t.measurement.predictor_bytes for t in ladder.trials
                 if t.point.rung == r.rung and t.point.context_length == r.context_length
                 and t.point.grad_accum_steps == 1 and t.measurement.predictor_bytes is not None}
        chosen = c is not None and c.rung == r.rung and c.context_length == r.context_length  # (not cut further)
        plan = c.micro_batch_size if chosen and c.grad_accum_steps > 1 else None
        out[r.rung] = RungPrior(r.context_length, r.micro_batch_size, tuple(sorted(peaks.items())), plan, chosen)
    return out


class CertifyingSearch(LadderSearch):
    """The ladder (LadderSearch.run) with each rung certified from its prior where it has one."""

    def __init__(self, measure: Callable[[Point], Measurement], limit_bytes: int, priors: dict[Rung, RungPrior],
                 on_trial: Callable[[Trial], None] | None = None):
        super().__init__(measure, limit_bytes, on_trial)
        self.priors = priors
        self.fell_back: list[str] = []  # the rungs whose prior was off: searched instead
        self.certify_plans = False  # where a rung will accumulate, certify its plan (run() decides)

    def run(self, rungs, batch: int, context: int, min_context: int, objective: Objective = "fit", past=(),
            accumulation: bool = True) -> LadderResult:
        """As the search's; under the fit objective with accumulation, a rung that will accumulate is certified by
        its plan (the throughput objective compares rungs' speeds alone, measured without accumulation)."""
        self.certify_plans = objective == "fit" and accumulation
        return super().run(rungs, batch, context, min_context, objective, past, accumulation)

    def search_rung(self, rung: Rung, batch: int, context: int, min_context: int) -> RungResult:
        prior = self.priors.get(rung)
        if prior is None or rung.optimizer_in_backward:  # (the whole batch or nothing: one trial either way)
            return super().search_rung(rung, batch, context, min_context)
        start = len(self.trials)
        certified = self._certify(rung, batch, context, min_context, prior)
        if certified is None:  # searched from scratch, with every trial run so far known
            self.fell_back.append(rung.name)
            r = super().search_rung(rung, batch, context, min_context)
            certified = r.context_length, r.micro_batch_size, 1
        return RungResult(rung, *certified[:2], len(self.trials) - start, certified[2])

    def check(self, point: Point, stage: str) -> bool:
        """As the search's, but a point at least as large as one that went over the limit (its micro-batch and
        context no smaller, on the rung, at its accumulation) is known not to fit without a trial: the search a
        rung falls back to starts where the certifying trials left off, not from its own first guesses."""
        if point not in self._seen and any(
                not t.fits and q.rung == point.rung and q.grad_accum_steps == point.grad_accum_steps
                and q.micro_batch_size <= point.micro_batch_size and q.context_length <= point.context_length
                for q, t in self._seen.items()):
            return False
        return super().check(point, stage)

    def _certify(self, rung: Rung, batch: int, context: int, min_context: int,
                 prior: RungPrior) -> tuple[int | None, int | None, int] | None:
        """(T_S, b_S, 1) or (T_S, d, B/d: the plan) certified on the device, or None where the prior is off."""
        t_s = prior.context_length
        if t_s is None:  # predicted: nothing fits; one trial says so
            return None if self.check(Point(rung, 1, min_context), "prior") else (None, None, 1)
        if t_s < context:  # the next context up must not fit micro-batch 1
            longer = next(c for c in context_candidates(min_context, context) if c > t_s)
            if self.check(Point(rung, 1, longer), "prior"):
                return None
        predicted = min(prior.micro_batch_size or 1, batch)
        d = prior.plan_micro_batch or largest_divisor_at_most(batch, predicted)
        if self.certify_plans and predicted < batch and 2 * d > predicted:
            guess, d = d, self._certify_plan(rung, t_s, batch, d)
            # a plan that stepped down on the rung the estimate chose: is it still within a factor of two of what
            # fits alone (one trial says; the divisor note speaks of that rung only)?
            if d is not None and (d >= guess or not prior.chosen or not self._fits_alone(rung, t_s, 2 * d, batch)):
                return t_s, d, batch // d
        # alone (also where the plan runs at half of what fits alone or less, or none fits: the probe says why)
        b = self._certify_batch(rung, t_s, batch, prior)
        return None if b is None else (t_s, b, 1)

    def _fits_alone(self, rung: Rung, context: int, b: int, batch: int) -> bool:
        return b <= batch and self.check(Point(rung, b, context), "verify")

    def _certify_plan(self, rung: Rung, context: int, batch: int, guess: int) -> int | None:
        """The largest divisor d of `batch` whose plan (d x batch/d) fits at `context`, certified: it fits and the
        next divisor's plan does not (for d = batch: the target alone). From the predicted divisor, each trial
        steps to the neighbouring divisor, up to MAX_CORRECTIONS + 1 steps. None: still not certified then, or not
        even 1 x batch fits (the rung is then certified alone)."""
        divs = [d for d in range(1, batch + 1) if batch % d == 0]
        lo, hi = -1, len(divs)  # divs[lo]'s plan fits, divs[hi]'s does not (-1, len(divs): none known)
        i, stage = divs.index(guess), "prior"
        for _ in range(MAX_CORRECTIONS + 2):  # the prediction, the size above, and the corrections
            if hi - lo <= 1:
                break
            d = divs[i]
            if self.check(Point(rung, d, context, batch // d), stage):
                lo, i, stage = i, i + 1, "verify"
            else:
                hi, i, stage = i, i - 1, "corrected"
        return divs[lo] if hi - lo <= 1 and lo >= 0 else None

    def _certify_batch(self, rung: Rung, context: int, batch: int, prior: RungPrior) -> int | None:
        """The largest micro-batch that fits at `context`, certified (it fits, the next size does not), from the
        prior's prediction corrected by what the device measured; None to fall back."""
        guess, stage = min(prior.micro_batch_size or 1, batch), "prior"
        for _ in range(MAX_CORRECTIONS + 1):
            lo, hi = self._bounds(rung, context, batch)
            if hi - lo <= 1:
                return lo if lo >= 1 else None
            guess = min(max(guess, lo + 1), hi - 1)
            if self.check(Point(rung, guess, context), stage):
                if guess == batch or not self.check(Point(rung, guess + 1, context), "verify"):
                    return guess
            offsets = self._offsets(rung, context, prior)
            if offsets and abs(offsets[0][2]) > FALLBACK_ERROR:
                return None
            if not offsets and stage == "corrected":
                return None  # the step back ran out of memory too: no peak to correct from
            guess, stage = self._corrected(rung, context, batch, prior, offsets), "corrected"
        return None

    def _offsets(self, rung: Rung, context: int, prior: RungPrior) -> list[tuple[int, float, float]]:
        """(micro-batch, device peak - fake peak, that as a share of the fake peak) for each size the device ran
        with a peak, in the order it ran them."""
        out = []
        for t in self.trials:
            p = t.point
            if p.rung == rung and p.context_length == context and p.grad_accum_steps == 1 \
                    and t.measurement.predictor_bytes is not None:
                fake = prior.peak_at(p.micro_batch_size)
                if fake:
                    off = t.measurement.predictor_bytes - fake
                    out.append((p.micro_batch_size, off, off / fake))
        return out

    def _corrected(self, rung: Rung, context: int, batch: int, prior: RungPrior,
                   offsets: list[tuple[int, float, float]]) -> int:
        """The largest size whose fake peak plus the device's offset (constant from one point, a line through the
        offsets of the two largest sizes from two) stays under the limit, within what is known. With no offset
        measured yet (the prediction ran out of memory outright, leaving no peak), the offset is taken as large as a
        prior may be off (FALLBACK_ERROR of the fake peak): if that size runs out too, the prior is off by more."""
        pts = sorted({b: off for b, off, _ in offsets}.items())[-2:]

        def offset(b: int) -> float:
            if not pts:
                return FALLBACK_ERROR * (prior.peak_at(b) or 0)
            if len(pts) == 1:
                return pts[0][1]
            (b0, o0), (b1, o1) = pts
            return o0 + (o1 - o0) * (b - b0) / (b1 - b0)

        lo, hi = self._bounds(rung, context, batch)
        best = lo
        for b in range(lo + 1, hi):
            fake = prior.peak_at(b)
            if fake is None or fake + offset(b) > self.limit_bytes:
                break
            best = b
        return best + 1 if best == lo else best  # nothing new predicted to fit: certify lo by trying lo + 1
