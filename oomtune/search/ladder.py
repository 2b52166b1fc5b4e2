"""The ladder and the per-rung search. No torch here: memory is seen only through `measure`.

Ladder: for each rung in order (fp32, +amp, +checkpointing, and on several ranks +fsdp) find the largest context T_S in
[T_min, T] at which micro-batch 1 fits (context first: batch can be recovered by accumulation, context cannot), then
the largest micro-batch b_S <= B at T_S. Stop at the first rung that fits (T, B) outright; otherwise take the best
rung and add accumulation: micro-batch b (the largest divisor of B not above b_S) and B / b accumulation steps, so
the global batch stays exactly B. Where not even 1 x B fits at any rung's T_S (accumulation keeps the gradients
alive), the context is cut further, towards T_min (shorter_context).

Per rung, memory is close to affine in the micro-batch (strictly: convex, the max over the step of
lines in b), so two measured peaks predict the largest batch under the limit; the prediction is
verified (b fits and b+1 does not). A miss that still measured a peak (over the limit but under the
budget) brackets the answer and the chord between the bracket's ends predicts again; a miss that ran
out of memory outright gives no peak, so the search bisects when the line points at a size already
known not to fit. A rung costs 4-7 trials whatever the answer (bench/RESULTS.md), where
doubling-then-bisecting costs about 2*log2(b_max): fewer below a max of ~16, more above ~64.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

Objective = Literal["fit", "throughput"]


@dataclass(frozen=True)
class Rung:
    name: str  # fp32 | amp | checkpointing | fsdp | past accumulation: bf16-true, +8bit, +nf4, +offload, ...
    precision: str  # fp32 | bf16 | fp16 | bf16-true
    activation_checkpointing: bool
    sharding: str = "none"  # none (one process) | ddp (replicated on every rank) | fsdp (sharded across them)
    optimizer_8bit: bool = False
    nf4_frozen_weights: bool = False
    offload_optimizer: bool = False
    offload_activations: bool = False
    chunked_loss: bool = False
    optimizer_in_backward: bool = False  # no accumulation: its plan is the whole batch at once, or none
    compile: bool = False  # every rung of a search asked to compile (--compile)


@dataclass(frozen=True)
class Point:
    rung: Rung
    micro_batch_size: int
    context_length: int
    grad_accum_steps: int = 1


@dataclass(frozen=True)
class Measurement:
    oom: bool
    peak_bytes: int | None = None  # decides fit
    tokens_per_s: float | None = None
    batch_peak_bytes: int | None = None  # the part of the step whose memory grows with the batch; predicts

    @property
    def predictor_bytes(self) -> int | None:
        return self.batch_peak_bytes if self.batch_peak_bytes is not None else self.peak_bytes


@dataclass(frozen=True)
class Trial:
    point: Point
    stage: str  # target | context | batch | verify
    measurement: Measurement
    fits: bool

    @property
    def result(self) -> str:
        if self.measurement.oom:
            return "oom"
        return "fits" if self.fits else "over-headroom"


@dataclass(frozen=True)
class RungResult:
    rung: Rung
    context_length: int | None  # T_S; None when micro-batch 1 does not fit even at T_min
    micro_batch_size: int | None  # b_S
    trials: int  # trials this rung ran
    # 1: b_S is the largest micro-batch that fits alone. B/d (certified from a prior, certify.py): b_S is the plan's
    # micro-batch d, the largest divisor of B that fits with that accumulation; the largest alone is not known
    grad_accum_steps: int = 1

    @property
    def found(self) -> bool:
        return self.context_length is not None


@dataclass(frozen=True)
class Choice:
    rung: Rung
    micro_batch_size: int
    context_length: int
    grad_accum_steps: int
    peak_bytes: int | None
    tokens_per_s: float | None

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps


@dataclass(frozen=True)
class LadderResult:
    rungs: tuple[RungResult, ...]
    choice: Choice | None
    trials: tuple[Trial, ...] = field(default=())


def fits_within(m: Measurement, limit_bytes: int) -> bool:
    """A trial fits when it ran without OOM and its peak left the headroom free."""
    return not m.oom and m.peak_bytes is not None and m.peak_bytes <= limit_bytes


def context_candidates(min_context: int, context: int) -> list[int]:
    """Context lengths the search may pick, ascending: T_min, multiples of a round step, T.
    The step is a power of two near T/16, so a cut context is a friendly number (T=1024 -> 64s)."""
    quantum = 1
    while quantum * 2 <= context // 16:
        quantum *= 2
    inner = range((min_context // quantum + 1) * quantum, context, quantum)
    return sorted({min_context, *inner, context})


def largest_divisor_at_most(n: int, cap: int) -> int:
    """The micro-batch that keeps the global batch exact: the largest d <= cap with n % d == 0."""
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def extrapolate(b1: int, p1: int, b2: int, p2: int, limit_bytes: int) -> int | None:
    """The line through two fitting points (b1 < b2), solved for the largest b under the limit. Peak memory
    is the max over the step of lines in b, so it is convex in b: this over-estimates. None when memory
    does not grow with b."""
    slope = (p2 - p1) / (b2 - b1)
    if slope <= 0:
        return None
    return b2 + int((limit_bytes - p2) // slope)


def interpolate(b_in: int, p_in: int, b_out: int, p_out: int, limit_bytes: int) -> int:
    """The chord between a point under the limit and one over it, solved for the limit. For a convex peak
    the chord lies above the curve, so this under-estimates (never past the true largest batch)."""
    return b_in + int((limit_bytes - p_in) * (b_out - b_in) // (p_out - p_in))


class LadderSearch:
    """Runs the ladder against `measure(point) -> Measurement`, never measuring a point twice."""

    def __init__(self, measure: Callable[[Point], Measurement], limit_bytes: int,
                 on_trial: Callable[[Trial], None] | None = None):
        self.measure = measure
        self.limit_bytes = limit_bytes
        self.on_trial = on_trial
        self.trials: list[Trial] = []
        self._seen: dict[Point, Trial] = {}
        self.out_of_reach: frozenset[str] = frozenset()  # rungs no plan of which can fit (their floor): not tried
        self.reaches: Callable[[Rung], bool] = lambda rung: True  # a rung past accumulation can fit (asked once)

    def check(self, point: Point, stage: str) -> bool:
        if point not in self._seen:
            m = self.measure(point)
            trial = Trial(point, stage, m, fits_within(m, self.limit_bytes))
            self._seen[point] = trial
            self.trials.append(trial)
            if self.on_trial:
                self.on_trial(trial)
        return self._seen[point].fits

    # -- one rung --------------------------------------------------------------------------------
    def search_rung(self, rung: Rung, batch: int, context: int, min_context: int) -> RungResult:
        start = len(self.trials)
        done = lambda t, b: RungResult(rung, t, b, len(self.trials) - start)  # noqa: E731
        if (batch > 1 or rung.optimizer_in_backward) and self.check(Point(rung, batch, context), "target"):
            return done(context, batch)
        if rung.optimizer_in_backward:  # (the whole batch or nothing: it cannot accumulate smaller ones)
            return done(None, None)
        if self.check(Point(rung, 1, context), "context"):
            best_context = context
        else:
            best_context = self.largest_context(rung, min_context, context)
            if best_context is None:
                return done(None, None)
        return done(best_context, self.largest_batch(rung, best_context, batch))

    def largest_context(self, rung: Rung, min_context: int, context: int) -> int | None:
        """Bisect the candidate contexts for the largest at which micro-batch 1 fits ((1, T) did not)."""
        if min_context >= context or not self.check(Point(rung, 1, min_context), "context"):
            return None
        cands = context_candidates(min_context, context)
        lo, hi = 0, len(cands) - 1  # cands[lo] fits, cands[hi] does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.check(Point(rung, 1, cands[mid]), "context"):
                lo = mid
            else:
                hi = mid
        return cands[lo]

    def largest_batch(self, rung: Rung, context: int, batch: int) -> int:
        """Largest micro-batch <= batch that fits at `context`, given that 1 fits there.

        The next size tried is, in order of preference:
        1. b+1 right after a predicted b fit (the verify that makes a prediction exact);
        2. the chord between the largest fitting point and the smallest over-the-limit point with a peak;
        3. the line through the two largest fitting points; the second point is the geometric middle of
           what is still unknown (16 for a target of 256), not 2: at tiny batches the weights, gradients
           and optimizer state set the peak, and a line through 1 and 2 would be nearly flat;
        4. the midpoint (bisection): whenever the line predicts a size already known not to fit, i.e. its
           last prediction ran out of memory outright and left no new peak to refit with.
        Once two sizes that fit read the same peak, the peak moves in steps (a card's allocator model reserves
        2 MiB segments: a small model's whole batch can be a few steps), the lines are flat or short and would walk
        the sizes one or two at a time (41 trials on one rung): the search then gallops up from the largest size
        that fits (by the widest flat run seen, at least 2, doubling), never past the midpoint of what is
        unknown."""
        lo, hi = self._bounds(rung, context, batch)
        verify_next, gallop = False, 2
        while hi - lo > 1:
            fit, over, peak = self._batch_points(rung, context, lo)
            stage, guess = "batch", None
            # (not from the smallest: at tiny batches the optimizer step sets the peak, flat, and bisection serves)
            flats = [b - a for a, b in zip(fit[1:], fit[2:], strict=False) if peak[a] == peak[b]]
            stepped = bool(flats)
            if stepped:  # gallop up from the largest that fits, never past the midpoint: then bisect
                gallop = max(gallop, max(flats))  # a step is at least as wide as its widest flat seen
                guess = min(lo + gallop, (lo + hi) // 2)
            elif verify_next:
                stage, guess = "verify", lo + 1
            elif over:
                guess = interpolate(lo, peak[lo], over[0], peak[over[0]], self.limit_bytes)
            elif len(fit) >= 2:
                line = extrapolate(fit[-2], peak[fit[-2]], fit[-1], peak[fit[-1]], self.limit_bytes)
                if line is None or line >= hi:  # past what is known not to fit: bisect, unless that is the target
                    guess = hi - 1 if hi == batch + 1 else None
                else:
                    guess = line
            else:
                # the second point for the line, far enough from 1 that the batch, not the weights, sets it
                guess = math.isqrt(lo * hi)
            predicted = guess is not None and stage == "batch" and len(fit) >= 2 and not stepped
            if guess is None:
                guess = (lo + hi) // 2
            guess = min(max(guess, lo + 1), hi - 1)
            ok = self.check(Point(rung, guess, context), stage)
            verify_next = ok and predicted
            if stepped and ok:
                gallop *= 2
            lo, hi = (guess, hi) if ok else (lo, guess)
        return lo

    def _bounds(self, rung: Rung, context: int, batch: int) -> tuple[int, int]:
        """(largest micro-batch known to fit at `context`, 0 when none; smallest known not to, batch+1 when none)."""
        seen = self._at(rung, context)
        lo = max([b for b, t in seen.items() if t.fits], default=0)
        hi = min([b for b, t in seen.items() if not t.fits] + [batch + 1])
        return lo, hi

    def _at(self, rung: Rung, context: int) -> dict[int, Trial]:
        return {p.micro_batch_size: t for p, t in self._seen.items()
                if p.rung == rung and p.context_length == context and p.grad_accum_steps == 1}

    def _batch_points(self, rung: Rung, context: int, lo: int) -> tuple[list[int], list[int], dict[int, int]]:
        """Measured sizes that fit, sizes above lo that ran but went over the limit, and their peaks."""
        seen = {b: t for b, t in self._at(rung, context).items() if t.measurement.predictor_bytes is not None}
        fit = sorted(b for b, t in seen.items() if t.fits)
        over = sorted(b for b, t in seen.items() if not t.fits and b > lo)
        return fit, over, {b: seen[b].measurement.predictor_bytes for b in fit + over}

    # -- the ladder ------------------------------------------------------------------------------
    def run(self, rungs: Sequence[Rung], batch: int, context: int, min_context: int,
            objective: Objective = "fit", past: Sequence[Rung] = (), accumulation: bool = True) -> LadderResult:
        """Climb `rungs`; then `past` (the rungs past accumulation, cheapest first), only while no plan fits at
        the target context: the first rung whose plan does (micro-batch 1 and accumulation, at least) ends the
        climb. `accumulation=False`: a plan must fit the whole batch at once, and `past` is climbed while no rung
        fits the whole batch at the target context."""
        results: list[RungResult] = []
        for i, rung in enumerate([*rungs, *past]):
            if i >= len(rungs) and self._reached(results, batch, context, objective, accumulation):
                break  # the target context is reached: no costlier lever is needed
            passed = rung.name in self.out_of_reach or (i >= len(rungs) and not self.reaches(rung))
            r = RungResult(rung, None, None, 0) if passed else self.search_rung(rung, batch, context, min_context)
            results.append(r)
            if objective == "fit" and r.context_length == context and r.micro_batch_size == batch:
                break
        choice = self.choose(results, batch, context, objective, accumulation)
        if choice is None and accumulation and batch > 1:
            choice = self.shorter_context(results, batch, min_context)
        return LadderResult(tuple(results), choice, tuple(self.trials))

    def shorter_context(self, results: Sequence[RungResult], batch: int, min_context: int) -> Choice | None:
        """No rung's plan fits at its T_S, where micro-batch 1 fits alone: accumulation keeps every gradient alive
        through the next micro-step, and 1 x B does not fit there. The context is then cut further, as far as
        T_min: for each rung (the longest T_S first, ties to the earlier rung), the longest context at which
        1 x B fits, and there the largest plan (largest_batch alone, then a divisor of B that fits accumulated).
        The longest context wins; a rung whose T_S is no longer than it is not searched."""
        best: Choice | None = None
        for r in sorted((r for r in results if r.found and not r.rung.optimizer_in_backward),
                        key=lambda r: -r.context_length):
            if best is not None and r.context_length <= best.context_length:
                break
            t = self._longest_accumulated(r.rung, min_context, r.context_length, batch)
            if t is None or (best is not None and t <= best.context_length):
                continue
            alone = self.largest_batch(r.rung, t, batch)
            best = self._with_accumulation(RungResult(r.rung, t, alone, 0), batch) or best
        return best

    def _longest_accumulated(self, rung: Rung, min_context: int, context: int, batch: int) -> int | None:
        """Bisect the candidate contexts in [min_context, context] for the longest at which 1 x batch fits."""
        plan_fits = lambda t: self.check(Point(rung, 1, t, batch), "context")  # noqa: E731
        if not plan_fits(min_context):
            return None
        cands = context_candidates(min_context, context)
        lo, hi = 0, len(cands) - 1  # cands[lo] fits; cands[hi] is known not to, unless it is checked and fits
        if plan_fits(cands[hi]):
            return cands[hi]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if plan_fits(cands[mid]) else (lo, mid)
        return cands[lo]

    def _reached(self, results: Sequence[RungResult], batch: int, context: int, objective: Objective,
                 accumulation: bool) -> bool:
        """Does a plan fit at the target context? A micro-batch that fits alone there is not enough: accumulation
        keeps every gradient alive through the next micro-step, so its plan is verified (the trials choose() runs
        at the end anyway, where it fits)."""
        reach = 1 if accumulation else batch
        if not any(r.context_length == context and (r.micro_batch_size or 0) >= reach for r in results):
            return False
        choice = self.choose(results, batch, context, objective, accumulation)
        return choice is not None and choice.context_length == context

    def _trial(self, rung: Rung, b: int, t: int, accum: int = 1) -> Trial | None:
        return self._seen.get(Point(rung, b, t, accum))

    def choose(self, results: Sequence[RungResult], batch: int, context: int,
               objective: Objective, accumulation: bool = True) -> Choice | None:
        """The plan: rungs in order of preference, the first whose plan (with accumulation, verified) fits."""
        found = [r for r in results if r.found]
        if objective == "fit":
            full = [r for r in found if r.context_length == context and r.micro_batch_size == batch]
            # else the best rung: the longest context, then the largest micro-batch of its plan (the largest divisor
            # of B it fits: what runs); ties go to the earlier rung
            picks = full[:1] or sorted(found, key=lambda r: (
                -r.context_length, -largest_divisor_at_most(batch, r.micro_batch_size)))
        else:
            best_t = max((r.context_length for r in found), default=0)  # context is never traded for speed
            picks = sorted((r for r in found if r.context_length == best_t),
                           key=lambda r: -(self._speed(r, batch) or 0.0))
        picks = [r for r in picks if accumulation and not r.rung.optimizer_in_backward or r.micro_batch_size == batch]
        if objective == "fit":
            return self._largest_plan(picks, batch, [r.rung for r in results])
        for r in picks:  # accumulation keeps gradients alive across micro-steps: it can fail where b_S fit
            choice = self._with_accumulation(r, batch)
            if choice is not None:
                return choice
        return None

    def _largest_plan(self, picks: Sequence[RungResult], batch: int, order: Sequence[Rung]) -> Choice | None:
        """The largest verified plan among `picks` (in order: the longest context, then the largest divisor of B
        each fits): a rung's plan steps below its divisor where accumulation does not fit, so a later rung whose
        divisor is larger is verified too, until none could do better. Ties go to the earlier rung of the ladder
        (`order`): where a plan stepped down to a divisor an earlier rung also fits, that rung's plan is verified
        too (a cheaper rung: no checkpointing's recompute, say)."""
        best: Choice | None = None
        for r in picks:
            d = largest_divisor_at_most(batch, r.micro_batch_size)
            if best is not None and (r.context_length < best.context_length or d < best.micro_batch_size):
                break
            if best is not None and d == best.micro_batch_size and order.index(r.rung) > order.index(best.rung):
                continue  # the same plan on a later rung: no better
            floor = best.micro_batch_size - (d == best.micro_batch_size) if best else 0
            choice = self._with_accumulation(r, batch, floor=floor)
            if choice is not None:  # (larger than `best`, or as large on an earlier rung: the floor saw to that)
                best = choice
        return best

    def _speed(self, r: RungResult, batch: int) -> float | None:
        b = largest_divisor_at_most(batch, r.micro_batch_size)
        trial = self._trial(r.rung, b, r.context_length) or self._trial(r.rung, r.micro_batch_size, r.context_length)
        return trial.measurement.tokens_per_s if trial else None

    def _with_accumulation(self, r: RungResult, batch: int, floor: int = 0) -> Choice | None:
        """Micro-batch b dividing B, accumulation B / b; a plan with accumulation is verified by a trial. None where
        no plan with a micro-batch above `floor` fits."""
        cap = r.micro_batch_size
        while cap > floor:
            b = largest_divisor_at_most(batch, cap)
            if b <= floor:
                return None
            accum = batch // b
            point = Point(r.rung, b, r.context_length, accum)
            if accum == 1 or self.check(point, "verify"):
                m = self._seen[point].measurement
                return Choice(r.rung, b, r.context_length, accum, m.peak_bytes, m.tokens_per_s)
            cap = b - 1  # accumulation itself did not fit: next smaller divisor
        return None
