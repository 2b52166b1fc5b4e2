"""The estimate's trials (estimate._replayed): the prior's ReplayingTrials, each run recorded for its breakdown where
its plan can be the answer, a peak past the budget an OOM, and a target bounded by micro-batch 1 where the model is
made from fewer blocks."""

from __future__ import annotations

import dataclasses
import functools

from ..config.schema import TRIAL_STEPS, MemoryBreakdown, Plan
from ..dist.group import LOCAL
from ..memory.breakdown import recorded_trial
from ..memory.devices import FakeDevice
from ..model_file import ModelFile
from ..units import format_bytes
from .ladder import Point
from .prior import ReplayingTrials
from .probe import plan_of
from .trial import TrialResult, run_trial


class ReplayedTrials(ReplayingTrials):
    """The estimate's trials, on the fake device's twin that never runs out (prior.prior_device): each plan is traced
    until two of its micro-batches line up, and every other micro-batch of it is replayed from them (replay.py);
    those run for a plan that can be the answer are recorded, so it has the breakdown of its own trial. A peak past
    the budget is an OOM, as on the device (the twin reports it instead of running out, which tells the search by
    how much)."""

    def __init__(self, budget_bytes: int, answers: int | None = None):
        super().__init__()
        self.budget_bytes = budget_bytes
        self.breakdowns: dict[Plan, MemoryBreakdown] = {}
        self.ahead: dict[Plan, TrialResult] = {}  # micro-batch 1 run before a plan's first size (_bounded)
        self.bounded: dict[Plan, tuple] = {}  # a target not traced -> how to trace it (peak_of)
        self.answers = answers  # the global batch an answer keeps (alone or accumulated): only plans of it are
        # recorded for a breakdown (a Recorder costs 5-12% of a trace); None: every plan

    def run_one(self, model_file: ModelFile, plan: Plan, device: FakeDevice, steps: int, dist) -> TrialResult:
        """The trial traced (from fewer blocks where they line up), recorded where its plan can be the answer."""
        trial = functools.partial(run_trial, second=self.second)  # (second steps made where that was checked)
        if self.answers is None or plan.micro_batch_size * plan.grad_accum_steps == self.answers:
            measure = lambda mf, p: recorded_trial(mf, p, device, steps, dist, trial)  # noqa: E731
        else:
            measure = lambda mf, p: (trial(mf, p, device, steps, dist=dist), None)  # noqa: E731
        made = self.blocks.trial(model_file, plan, device, measure, (self.second,))
        result, bd = made or measure(model_file, plan)
        if bd is not None:
            self.breakdowns[plan] = bd
        return result

    def __call__(self, model_file: ModelFile, plan: Plan, device: FakeDevice, steps: int = TRIAL_STEPS,
                 dist=LOCAL) -> TrialResult:
        ahead = self.ahead.pop(plan, None)
        if ahead is not None:
            return ahead
        bounded = self._bounded(model_file, plan, device, steps, dist)
        return bounded if bounded is not None else self._within(super().__call__(model_file, plan, device, steps, dist))

    def _within(self, result: TrialResult) -> TrialResult:
        if not result.oom and (result.peak_bytes or 0) > self.budget_bytes:
            result = dataclasses.replace(result, oom=True, tokens_per_s=None)
        return result

    def _bounded(self, model_file: ModelFile, plan: Plan, device: FakeDevice, steps: int, dist) -> TrialResult | None:
        """A model made from fewer blocks (each trial a few seconds): before a plan's first size above 1 (the
        ladder's target), its micro-batch 1 at that context, which the ladder tries next where the target does
        not fit. Where micro-batch 1 does not fit, neither does the target (memory grows with the batch): its OOM
        is known without a trace (`bounded`). Else None: the target is traced (micro-batch 1 waits for the
        ladder)."""
        one = dataclasses.replace(plan, micro_batch_size=1, global_batch_size=0)
        if (plan.micro_batch_size == 1 or plan.grad_accum_steps != 1 or dist.world_size != 1
                or plan.optimizer_in_backward or one in self.ahead or one in self.traces or one in self.lines
                or one in self.blocks.off or not self.blocks.blocks or self.blocks.blocks < self.blocks.min_blocks):
            return None
        self.ahead[one] = first = self._within(super().__call__(model_file, one, device, steps, dist))
        if not first.oom:
            return None
        self.bounded[plan] = (model_file, device, steps, dist)
        return TrialResult(plan, oom=True, bounded=True, oom_message=(
            f"micro-batch 1 of it does not fit ({format_bytes(first.peak_bytes or 0)}): micro-batch "
            f"{plan.micro_batch_size} needs more"))

    def peak_of(self, point: Point) -> int | None:
        """The peak of a bounded target's trial, traced now (rung_notes asks where it must compare it); None for
        any other point."""
        plan = plan_of(point)
        how = self.bounded.pop(plan, None)
        return super().__call__(how[0], plan, *how[1:]).peak_bytes if how is not None else None
