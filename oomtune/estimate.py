"""The estimator: the probe's ladder on the fake device plus the breakdown of what it chose (or, when nothing
fits, of the smallest plan, with the reason and the levers that would help); `what_if` for one plan;
`check`: re-measure a config's plan and compare (the CI gate).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from . import parallel
from .breakdown import (
    breakdown,
    breakdown_difference,
    levers,
    static_memory,
    why_nothing_fits,
)
from .devices import CpuDevice, Device, FakeDevice, TrackedDevice, make_device
from .errors import BAD_INPUT, OomtuneError
from .gpus_table import Margin, find_gpu, parse_margin
from .model_file import ModelFile
from .plan import HEADROOM, TRIAL_STEPS, Config, MemoryBreakdown, Plan, TrialRecord
from .probe import (
    ProbeResult,
    check_headroom,
    check_search_options,
    check_steps,
    fsdp_reach,
    ladder_rungs,
    no_fsdp_note,
    plan_of,
    probe,
)
from .search import LadderResult, Point
from .trial import run_trial
from .units import parse_budget


@dataclass
class EstimateResult:
    search: object  # probe.ProbeResult: the ladder, its trials and the config (None when nothing fits)
    margin: Margin
    breakdown: MemoryBreakdown  # of the chosen plan, or of the smallest plan when nothing fits
    breakdown_plan: Plan
    levers: list[str] = field(default_factory=list)

    @property
    def config(self) -> Config | None:
        return self.search.config


def make_fake_device(budget: str | None, gpu: str | None, margin: str | None) -> FakeDevice:
    """--budget / --gpu / --margin -> the fake device that stands in for that GPU."""
    spec = find_gpu(gpu) if gpu else None
    if budget is None and spec is None:
        raise OomtuneError("say how much memory to fit in: --budget 24GiB or --gpu NAME (e.g. --gpu a100-80)")
    return FakeDevice(budget, gpu=spec, margin=parse_margin(margin))


def smallest_plan(device: Device, targets, amp: str, checkpointing_supported: bool, world_size: int = 1,
                  sharding: str | None = None) -> Plan:
    """The ladder's most frugal plan: micro-batch 1 at the shortest context allowed, on the last rung."""
    last = ladder_rungs(device, amp, checkpointing_supported, world_size, sharding)[-1]
    return plan_of(Point(last, 1, targets.min_context), world_size)


def check_estimate_options(objective: str, headroom: float, steps: int = TRIAL_STEPS, amp: str = "auto") -> None:
    """check_search_options, and throughput refused: the fake device measures no speed."""
    if objective == "throughput":
        raise OomtuneError("--objective throughput ranks rungs by measured speed, and the fake device computes "
                           "nothing; run `oomtune probe --objective throughput` where the model can run", BAD_INPUT)
    check_search_options(headroom, steps, objective, amp)


def estimate(model_file: ModelFile, device: FakeDevice, targets, *, headroom: float = HEADROOM,
             steps: int = TRIAL_STEPS, objective: str = "fit", amp: str = "auto", on_start: Callable | None = None,
             on_trial: Callable[[TrialRecord], None] | None = None, world_size: int = 1,
             sharding: str | None = None) -> EstimateResult:
    """The probe's ladder on the fake device, then the breakdown of its choice (see module doc).

    On `world_size` ranks the ladder runs in a fake process group (torch's `fake` backend: collectives do
    nothing) on rank 0, with FSDP2's own code: sharded weights, gradients and optimizer state, the units'
    gathered weights, full activations (DDP cannot wrap fake tensors: its reducer's buckets are added instead).
    `sharding` puts every rung on ddp or fsdp; by default the ladder replicates (ddp) and adds an fsdp rung."""
    check_estimate_options(objective, headroom, steps, amp)
    parallel.check_world(world_size, sharding)
    ranks = (parallel.fake_world(world_size) if world_size > 1 or sharding in ("ddp", "fsdp")
             else contextlib.nullcontext(None))
    with ranks as d:
        return _estimate(model_file, device, targets, headroom, steps, objective, amp, on_start, on_trial, d,
                         sharding)


def _estimate(model_file, device, targets, headroom, steps, objective, amp, on_start, on_trial, dist,
              sharding) -> EstimateResult:
    world = dist.world_size if dist is not None else 1
    limit = int(device.budget_bytes * (1 - headroom))
    static = static_memory(model_file)
    sharded_by, no_fsdp = fsdp_reach(device, world, sharding)
    if device.margin.total(static.total_bytes // sharded_by) > limit:
        # nothing can fit: skip the ladder (every trial would run out) and explain with the smallest plan
        search = ProbeResult(LadderResult((), None, ()), [], static, targets, limit, None, world_size=world,
                             budget_bytes=device.budget_bytes)
    else:
        search = probe(model_file, device, targets, headroom=headroom, steps=steps, objective=objective, amp=amp,
                       command="estimate", on_start=on_start, on_trial=on_trial, dist=dist, sharding=sharding)
    if search.config is not None:
        plan = search.config.plan
        bd = breakdown(model_file, plan, device, steps, dist)
        found_by = dataclasses.replace(search.config.found_by, breakdown=bd)
        search.config = dataclasses.replace(search.config, found_by=found_by)
        return EstimateResult(search, device.margin, bd, plan)
    plan = smallest_plan(device, targets, amp, static.checkpointing_supported, world, sharding)
    bd = breakdown(model_file, plan, device, steps, dist)
    search.why_nothing_fits = (why_nothing_fits(bd, plan, static, limit, device.budget_bytes, headroom, device.margin)
                               + no_fsdp_note(no_fsdp))
    return EstimateResult(search, device.margin, bd, plan,
                          levers(bd, static, limit, device.margin, headroom, plan.activation_checkpointing))


@dataclass(frozen=True)
class WhatIf:
    """One plan the user asked about: its breakdown and, given a budget, whether it fits."""

    plan: Plan
    breakdown: MemoryBreakdown
    limit_bytes: int | None
    budget_bytes: int | None
    headroom: float
    levers: tuple[str, ...] = ()

    @property
    def fits(self) -> bool | None:
        return None if self.limit_bytes is None else self.breakdown.peak_bytes <= self.limit_bytes


def what_if(model_file: ModelFile, plan: Plan, device: FakeDevice | None, margin: Margin, *, headroom: float = HEADROOM,
            steps: int = TRIAL_STEPS) -> WhatIf:
    """The breakdown of one plan; with a device (a budget), the verdict and levers too."""
    check_headroom(headroom)
    check_steps(steps)
    if device is None:  # no budget: the breakdown alone (it lifts any budget anyway)
        bd = breakdown(model_file, plan, FakeDevice(str(1 << 50), margin=margin), steps)
        return WhatIf(plan, bd, None, None, headroom)
    limit = int(device.budget_bytes * (1 - headroom))
    bd = breakdown(model_file, plan, device, steps)
    lev: tuple[str, ...] = ()
    if bd.peak_bytes > limit:
        static = static_memory(model_file)
        lev = tuple(levers(bd, static, limit, device.margin, headroom, plan.activation_checkpointing))
    return WhatIf(plan, bd, limit, device.budget_bytes, headroom, lev)


# -- check ---------------------------------------------------------------------------------------

CHECK_DEVICES = ("fake", "cpu", "cuda")


@dataclass(frozen=True)
class CheckResult:
    fits: bool
    plan: Plan
    device: str
    budget_bytes: int
    headroom: float
    limit_bytes: int
    old_peak_bytes: int | None  # what the config recorded (found_by.peak_bytes)
    new_peak_bytes: int | None  # None: ran out of memory outright (cuda)
    old: MemoryBreakdown | None  # the config's breakdown, if it has one
    new: MemoryBreakdown | None  # on fake / cpu
    oom_message: str | None = None
    budget_clamped_from: int | None = None  # cuda without --budget: the config's budget, more than is free now

    @property
    def difference(self) -> dict[str, int] | None:
        return breakdown_difference(self.old, self.new) if self.old is not None and self.new is not None else None


def check_margin(config: Config, margin: str | None) -> Margin:
    """--margin, else the margin the config was estimated with, else the default where the config's peak was
    a real GPU's, else none (a cpu probe's peak is tensors only: compare like with like)."""
    if margin is not None:
        return parse_margin(margin)
    fb = config.found_by
    if fb is not None and fb.breakdown is not None:
        return parse_margin(fb.breakdown.margin)
    if fb is not None and fb.device == "cuda":
        return parse_margin(None)
    return Margin()


def check(config: Config, model_file: ModelFile, *, device_kind: str = "fake", budget: str | None = None,
          headroom: float | None = None, margin: str | None = None, steps: int = TRIAL_STEPS) -> CheckResult:
    """Re-measure the config's plan and say whether it still fits the config's budget (or --budget)."""
    if device_kind not in CHECK_DEVICES:
        raise OomtuneError(f"--device {device_kind!r}: expected one of {', '.join(CHECK_DEVICES)}")
    if margin is not None and device_kind != "fake":  # cpu counts tensors only, cuda measures the real thing
        raise OomtuneError(f"--margin applies to --device fake only (the {device_kind} device does not add one)")
    check_steps(steps)
    fb = config.found_by
    if headroom is not None:
        check_headroom(headroom)
    elif fb is not None:
        headroom = fb.headroom
        check_headroom(headroom, "the config's found_by.headroom")
    else:
        headroom = HEADROOM
    spec = None
    if fb is not None and fb.gpu_name:
        try:
            spec = find_gpu(fb.gpu_name.removesuffix(" (estimated)"))
        except OomtuneError:
            spec = None
    if budget is None:
        if fb is None:
            raise OomtuneError("the config has no found_by section to take the budget from: give --budget")
        budget_bytes = fb.budget_bytes
    else:
        budget_bytes = parse_budget(budget, spec.memory_bytes if spec else None)
    clamped_from = None
    if device_kind == "fake":
        device: Device = FakeDevice(str(budget_bytes), gpu=spec, margin=check_margin(config, margin))
    elif device_kind == "cpu":
        device = CpuDevice(str(budget_bytes))
    else:
        device, clamped_from = _cuda_device(budget_bytes, clamp=budget is None)
        budget_bytes = device.budget_bytes
    limit = int(budget_bytes * (1 - headroom))
    old_bd = fb.breakdown if fb is not None else None
    old_peak = fb.peak_bytes if fb is not None else None
    if isinstance(device, TrackedDevice):
        bd = breakdown(model_file, config.plan, device, steps)
        return CheckResult(bd.peak_bytes <= limit, config.plan, device.kind, budget_bytes, headroom, limit,
                           old_peak, bd.peak_bytes, old_bd, bd)
    r = run_trial(model_file, config.plan, device, steps)
    fits = not r.oom and r.peak_bytes is not None and r.peak_bytes <= limit
    return CheckResult(fits, config.plan, device.kind, budget_bytes, headroom, limit, old_peak,
                       None if r.oom else r.peak_bytes, old_bd, None, r.oom_message, clamped_from)


def _cuda_device(budget_bytes: int, clamp: bool) -> tuple[Device, int | None]:
    """The GPU under `budget_bytes`. With `clamp` (no --budget: the config's, which was the free memory when it
    was probed) at most what is free now, and the config's budget when that was more (None when it was not)."""
    if not clamp:
        return make_device("cuda", str(budget_bytes)), None
    device = make_device("cuda")  # no budget: all that is free now
    free = device.budget_bytes
    device.lower_budget(budget_bytes)
    return device, (budget_bytes if free < budget_bytes else None)
