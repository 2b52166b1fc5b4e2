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
from . import fan_out
from .ladder import Point
from .prior import ReplayingTrials
from .probe import plan_of
from .trial import TrialResult, run_trial

SPECULATE = 0.5  # seconds a trial takes, at least, for the next rung's micro-batch 1 to be traced ahead in a copy
# (not before the estimate's first trial: both would fill the same cold caches, FakeTensor's and the first-of-kind
# calls', each its own; GPT-2 small's first rung so took as long with its micro-batch 1 ahead as without)


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
        self.speculated: dict[Plan, fan_out.Ahead] = {}  # micro-batch 1 traced ahead in a copy (_speculate)
        self.last_seconds = 0.0  # the last trial run's

    def run_one(self, model_file: ModelFile, plan: Plan, device: FakeDevice, steps: int, dist) -> TrialResult:
        """The trial traced (from fewer blocks where they line up), recorded where its plan can be the answer; taken
        from the copy that ran it ahead, where one did."""
        speculated = self.speculated.pop(plan, None)
        result, bd = speculated.result() if speculated is not None else \
            self._measured(model_file, plan, device, steps, dist)
        if bd is not None:
            self.breakdowns[plan] = bd
        self.last_seconds = result.seconds
        return result

    def _measured(self, model_file: ModelFile, plan: Plan, device: FakeDevice, steps: int, dist) -> tuple:
        trial = functools.partial(run_trial, second=self.second)  # (second steps made where that was checked)
        if self.answers is None or plan.micro_batch_size * plan.grad_accum_steps == self.answers:
            measure = lambda mf, p: recorded_trial(mf, p, device, steps, dist, trial)  # noqa: E731
        else:
            measure = lambda mf, p: (trial(mf, p, device, steps, dist=dist), None)  # noqa: E731
        return self.blocks.trial(model_file, plan, device, measure, (self.second,)) or measure(model_file, plan)

    def __call__(self, model_file: ModelFile, plan: Plan, device: FakeDevice, steps: int = TRIAL_STEPS,
                 dist=LOCAL) -> TrialResult:
        for other in [p for p in self.speculated if p != plan]:  # the search asked another first: not wanted
            self.speculated.pop(other).drop()
        ahead = self.ahead.pop(plan, None)
        if ahead is not None:
            return ahead
        bounded = self._bounded(model_file, plan, device, steps, dist)
        if bounded is not None:
            return bounded
        self._speculate(model_file, plan, device, steps, dist)
        return self._within(super().__call__(model_file, plan, device, steps, dist))

    def _speculate(self, model_file: ModelFile, plan: Plan, device: FakeDevice, steps: int, dist) -> None:
        """A rung's first size traced whole (not from fewer blocks, whose three traces run side by side already):
        its micro-batch 1 at that context, the search's next trial wherever the first size does not fit, traced at
        the same time in a copy of this process (fan_out.Ahead), where trials take SPECULATE seconds or more (the
        last one run did). Where the first size fits, the copy is dropped when the search asks for another."""
        one = dataclasses.replace(plan, micro_batch_size=1, global_batch_size=0)
        if (plan.micro_batch_size == 1 or plan.grad_accum_steps != 1 or dist.world_size != 1
                or self.last_seconds < SPECULATE or one in self.traces or one in self.lines or one in self.ahead
                or (self.blocks.blocks or 0) >= self.blocks.min_blocks or not fan_out.can_fan_out()
                or dataclasses.replace(one, context_length=1) in self.curves):
            return
        self.second.mark()
        self.speculated[one] = fan_out.Ahead(lambda: self._measured(model_file, one, device, steps, dist),
                                             self.second.handed, self.second.take)

    def close(self) -> None:
        """Copies still running ahead are stopped (the search is over)."""
        for ahead in self.speculated.values():
            ahead.drop()
        self.speculated.clear()

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
