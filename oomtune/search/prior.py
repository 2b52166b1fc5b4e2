"""The probe's prior: the same ladder on the fake device first, accounting as the probe's device does, so that each
rung can be certified on the device in two trials (certify.py)."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

from ..config.schema import TRIAL_STEPS, Plan
from ..dist.group import LOCAL
from ..errors import first_line
from ..memory.context_curves import CHECKED, Curves
from ..memory.devices import Device, FakeDevice, TrackedDevice
from ..memory.replay import Lines, Trace
from ..model_file import ModelFile
from ..units import counted
from .certify import RungPrior, priors_from
from .extrapolate import BlockTrials, as_lines
from .second_steps import SecondSteps
from .trial import TrialResult, run_trial


@dataclass
class PriorReport:
    """What the prior cost and did: its fake trials and seconds (apart from the device's), the rungs the device
    searched because the prior was off, or why there was none."""

    trials: int = 0  # fake trials run
    replayed: int = 0  # sizes replayed from two of them instead (ReplayingTrials)
    seconds: float = 0.0
    fell_back: tuple[str, ...] = ()
    missing: str | None = None  # why the probe ran without a prior (None: it had one)
    priors: dict = field(default_factory=dict, repr=False)  # Rung -> RungPrior

    def summary(self) -> str:
        """One line: how the probe's trials were chosen (the config's found_by.prior)."""
        if self.missing is not None:
            return f"searched without a prior: {self.missing}"
        off = f"; searched where it was off: {', '.join(self.fell_back)}" if self.fell_back else ""
        return f"certified from an estimate on fake tensors ({self.counts()}, {self.seconds:.1f} s){off}"

    def counts(self) -> str:
        """"9 fake trials" or "5 fake trials + 4 replayed"."""
        return counted(self.trials, "fake trial") + (f" + {self.replayed} replayed" if self.replayed else "")

    def to_json(self) -> dict:
        return {"used": self.missing is None, "fake_trials": self.trials, "replayed_trials": self.replayed,
                "fake_seconds": round(self.seconds, 2),
                "fell_back_rungs": list(self.fell_back), "why_not": self.missing}


def prior_device(device: Device) -> FakeDevice:
    """The fake device that accounts as `device` (cpu or cuda) does: a simulated device's own card and margin; for a
    real GPU, its card's profile (autocast, kernels, allocator, workspaces) without a context, which the GPU's
    budget (its free memory, the context already taken) excludes too. It never runs out of memory: a size past the
    limit reports its peak, which the search's chord uses (fewer fake trials than where it ran out). It traces its
    trials, for ReplayingTrials."""
    if isinstance(device, TrackedDevice):
        return FakeDevice(f"{device.budget_bytes}B", gpu=device.card, margin=device.margin, never_runs_out=True,
                          traces=True)
    card = dataclasses.replace(device.profile(), context_bytes=0)
    return FakeDevice(f"{device.budget_bytes}B", gpu=card, never_runs_out=True, traces=True)


class ReplayingTrials:
    """The prior's trials (probe's `trial`): each plan is run on the fake device, traced, until two of its
    micro-batches line up (memory/replay.py); every other micro-batch of that plan is then replayed from them, in
    milliseconds, instead of run. A plan with accumulation, and micro-batch 1 (whose tensors' layouts can differ
    from a larger batch's), are not replayed from other micro-batches; micro-batch 1's trace may still be one of
    the two, where it lines up with another (a layout that differs there makes other events, and then it does
    not). Micro-batch 1 at other contexts (the ladder's search for the longest that fits) is replayed from its
    traces at four contexts that line up (memory/context_curves.py), with or without accumulation."""

    def __init__(self):
        self.traces: dict[Plan, list[tuple[int, Trace]]] = {}  # plan at micro-batch 1 -> its traced trials
        self.lines: dict[Plan, Lines] = {}
        self.run = 0
        self.replayed = 0
        self.blocks = BlockTrials()  # a plan's trial from trials of fewer of the model's repeated blocks
        self.contexts: dict[Plan, list[tuple[int, Trace]]] = {}  # plan at micro-batch 1, any context -> its traces
        self.curves: dict[Plan, Curves | None] = {}  # ... -> their curves (None: they did not line up)
        self.second = SecondSteps()  # a trial's second step made from its first, where that was checked

    def __call__(self, model_file: ModelFile, plan: Plan, device: FakeDevice, steps: int = TRIAL_STEPS,
                 dist=LOCAL) -> TrialResult:
        key = (dataclasses.replace(plan, micro_batch_size=1, global_batch_size=0) if plan.grad_accum_steps == 1
               else None)
        lines = self.lines.get(key)
        if lines is not None and plan.micro_batch_size > 1:
            start = time.perf_counter()
            reading = device.replay(lines, plan.micro_batch_size)
            if reading is not None:
                self.replayed += 1
                return TrialResult.from_reading(plan, reading, replayed=True, seconds=time.perf_counter() - start)
        made = self._other_context(plan, device, key) if plan.micro_batch_size == 1 else None
        if made is not None:
            return made
        result = self.run_one(model_file, plan, device, steps, dist)
        self.run += 1
        if plan.micro_batch_size == 1 and result.trace is not None:
            self._at_context(plan, result.trace)
        if key is not None and lines is None and result.trace is not None:
            known = self.traces.setdefault(key, [])
            for batch, trace in known:
                found = Lines.through(trace, batch, result.trace, plan.micro_batch_size)
                if found is not None:
                    self.lines[key] = found
                    del self.traces[key]
                    break
            else:
                known.append((plan.micro_batch_size, result.trace))
        return result

    def _other_context(self, plan: Plan, device: FakeDevice, key: Plan | None) -> TrialResult | None:
        """Micro-batch 1 of `plan` replayed from its curves in the context, where it has them; its trace then
        stands for a traced one at that context (a second micro-batch lines up with it)."""
        start = time.perf_counter()
        curves = self.curves.get(dataclasses.replace(plan, context_length=1, global_batch_size=0))
        trace = curves.at(plan.context_length) if curves is not None else None
        reading = device.replay(as_lines(trace), 1) if trace is not None else None
        if reading is None:
            return None
        self.replayed += 1
        if key is not None and key not in self.lines:
            self.traces.setdefault(key, []).append((1, trace))
        return TrialResult.from_reading(plan, reading, trace=trace, replayed=True, seconds=time.perf_counter() - start)

    def _at_context(self, plan: Plan, trace: Trace) -> None:
        """A traced trial at micro-batch 1 joins its plan's traces at other contexts; at CHECKED of them, their
        curves are fitted, once."""
        key = dataclasses.replace(plan, context_length=1, global_batch_size=0)
        if key in self.curves:
            return
        points = self.contexts.setdefault(key, [])
        if any(t == plan.context_length for t, _ in points):
            return
        points.append((plan.context_length, trace))
        if len(points) >= CHECKED:
            self.curves[key] = Curves.through(points)
            del self.contexts[key]

    def run_one(self, model_file: ModelFile, plan: Plan, device: FakeDevice, steps: int, dist) -> TrialResult:
        """One trial run (traced), not replayed: from fewer of its blocks where that lines up (BlockTrials)."""
        made = self.blocks.trial(model_file, plan, device, lambda fewer, p: (
            run_trial(fewer, p, device, steps, dist=dist, second=self.second), None), (self.second,))
        return made[0] if made is not None else run_trial(model_file, plan, device, steps, dist=dist,
                                                          second=self.second)


# What the prior costs and saves, a rung: it traces about three sizes of it on fake tensors (the target, micro-batch
# 1, one more; the other sizes are replayed from two of them), and the device then runs two trials to certify the
# rung where the search alone bisects the batch (bench/RESULTS.md, "The probe from the estimate").
FAKE_TRIALS_PER_RUNG = 3
CERTIFYING_TRIALS = 2


def device_trials_saved(batch: int) -> int:
    """About how many device trials a rung's search alone runs beyond the two that certify it (at least one): a
    bisection of the micro-batch up to `batch`."""
    return max(1, math.ceil(math.log2(max(batch, 2))) - CERTIFYING_TRIALS)


def why_it_would_not_pay(device_seconds: float, fake_seconds: float, batch: int) -> str | None:
    """None where the prior's fake trials cost less wall time than the device trials they save, a rung (one of
    each timed at the same plan, `device_seconds` without building the model, which the device's later trials
    reuse); else why the probe searches without it (found_by.prior)."""
    saved = device_trials_saved(batch)
    if FAKE_TRIALS_PER_RUNG * fake_seconds < saved * device_seconds:
        return None
    return (f"it would not pay: a trial on fake tensors took {fake_seconds:.2f} s against {device_seconds:.2f} s "
            f"on the device, and the estimate's ~{FAKE_TRIALS_PER_RUNG} fake trials a rung would cost more than "
            f"the ~{saved} device trials a rung it saves (--prior runs it anyway)")


def fake_trial_seconds(model_file: ModelFile, plan: Plan, device: Device, steps: int) -> float | str:
    """The wall time of one trial of `plan` on the fake device that stands in for `device` (as the prior runs it),
    or why it could not run (the prior could not either)."""
    start = time.perf_counter()
    try:
        run_trial(model_file, plan, prior_device(device), steps)
    except Exception as e:  # noqa: BLE001 - as run_prior: the device's own search can do without
        return f"the estimate of {model_file.label} on fake tensors failed: {first_line(e)}"
    return time.perf_counter() - start


def run_prior(run_ladder, device: Device, label: str, repeats: tuple | None = None) -> PriorReport:
    """`run_ladder(fake_device, trial) -> ProbeResult` on the fake device standing in for `device`, with
    ReplayingTrials, told the model's repeated blocks (StaticMemory.repeated_blocks: else its first trial measured a
    model cut to 2 of them only to learn how many there are, and threw it away where they were too few, as they are
    in most); the priors of the rungs it searched. Where the fake device cannot stand in or cannot run the model (an
    op that needs tensor values, too: the prior never computes the model on the host), the report says why and has
    none (the device then searches as without a prior)."""
    fake = prior_device(device)
    trials = ReplayingTrials()
    trials.blocks.knowing(repeats)
    start = time.perf_counter()
    try:
        result = run_ladder(fake, trials)
    except Exception as e:  # noqa: BLE001 - whatever the fake device cannot do, the device's own search can
        return PriorReport(trials.run, trials.replayed, time.perf_counter() - start,
                           missing=f"the estimate of {label} on fake tensors failed: {first_line(e)}")
    return PriorReport(trials.run, trials.replayed, time.perf_counter() - start, priors=priors_from(result.ladder))


__all__ = ["PriorReport", "ReplayingTrials", "RungPrior", "fake_trial_seconds", "prior_device", "run_prior",
           "why_it_would_not_pay"]
