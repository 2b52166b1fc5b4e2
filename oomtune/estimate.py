"""What the peak is made of, and the estimator built on it.

`static_memory`: the floor under every plan (weights, gradients, optimizer state), measured on fake tensors
so it costs no memory and works for a model far bigger than the machine.

`breakdown`: one run of a plan on a tracked device (fake or cpu) with a Recorder on the tracker, sorting
every storage live at the peak into parameters, gradients, optimizer state, autocast weight copies,
activations and temporaries. The parts sum to the tensor peak exactly, because they are the live set at
the moment of the peak, not a model of it.

`estimate`: the probe's ladder on the fake device plus the breakdown of what it chose (or, when nothing
fits, of the smallest plan, with the reason and the levers that would help). `check`: re-measure a
config's plan and compare.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .devices import CpuDevice, Device, FakeDevice, TrackedDevice, make_device
from .errors import BAD_INPUT, OomtuneError
from .gpus_table import GPUS, Margin, find_gpu, parse_margin
from .memtrack import MemoryTracker, Recorder
from .model_file import ModelFile
from .plan import Config, MemoryBreakdown, Plan, TrialRecord
from .units import format_bytes, parse_budget


@dataclass(frozen=True)
class StaticMemory:
    """Bytes that live through a whole step no matter the batch: the floor under every plan."""

    weights_bytes: int  # parameters and buffers
    gradients_bytes: int
    optimizer_bytes: int  # optimizer state after its first step (AdamW: two moments per parameter)
    optimizer_name: str
    checkpointing_supported: bool

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.gradients_bytes + self.optimizer_bytes

    def describe(self) -> str:
        return (f"weights {format_bytes(self.weights_bytes)} + gradients {format_bytes(self.gradients_bytes)} + "
                f"{self.optimizer_name} state {format_bytes(self.optimizer_bytes)} = {format_bytes(self.total_bytes)}")


def static_memory(model_file: ModelFile) -> StaticMemory:
    """Build the model on fake tensors, give every parameter a gradient and take one optimizer step,
    counting bytes after each stage (512-byte rounded, like the CUDA allocator)."""
    tracker = MemoryTracker()
    with FakeTensorMode(allow_non_fake_inputs=True), tracker, torch.device("cpu"):
        model = model_file.build()
        weights = tracker.live_bytes
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.zeros_like(p)
        grads = tracker.live_bytes - weights
        opt = model_file.optimizer(params, 1e-3)
        opt.step()
        optimizer_state = tracker.live_bytes - weights - grads
        checkpointing = model_file.supports_checkpointing(model)
        name = type(opt).__name__
        del model, params, opt
    return StaticMemory(weights, grads, optimizer_state, name, checkpointing)


# -- the breakdown --------------------------------------------------------------------------------

PART_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "autocast_copies": "autocast weight copies",
    "activations": "saved activations",
    "temporaries": "temporaries",
}
PART_HELP = {  # short: the CLI's table fits 80 columns
    "parameters": "weights and buffers",
    "gradients": "backward to zero_grad",
    "optimizer_state": "AdamW: 2 moments/param",
    "autocast_copies": "low-precision weights",
    "activations": "kept from forward for backward",
    "temporaries": "grads in flight, batch, scratch",
}

_TO_COPY = torch.ops.aten._to_copy.default


def _tag_autocast_copies(rec: Recorder, func, args, out) -> None:
    """A low-precision cast of a parameter is an autocast weight copy (autocast caches them per forward)."""
    if func is not _TO_COPY or not args or not isinstance(args[0], torch.Tensor) or not isinstance(out, torch.Tensor):
        return
    if out.dtype == args[0].dtype or out.dtype.itemsize >= args[0].dtype.itemsize:
        return
    src = rec.record_of(args[0])
    if src is not None and "parameter" in src.tags:
        dst = rec.record_of(out)
        if dst is not None:
            dst.tags.add("autocast")


def _observe(rec: Recorder, t, phase: str) -> None:
    """Tag what the model and optimizer hold, at the phase boundaries where it exists."""
    rec.mark(phase)
    if phase == "forward":
        rec.tag("parameter", *t.model.parameters(), *t.model.buffers())
    if phase == "optimizer":  # every gradient exists now; zero_grad(set_to_none) frees them after the step
        rec.tag("gradient", [p.grad for p in t.model.parameters() if p.grad is not None])
    if phase in ("forward", "end"):  # state made by the last step (its tensors live on into the next)
        rec.tag("optimizer", list(t.optimizer.state.values()))
        rec.tag("optimizer", [getattr(t.scaler, a, None) for a in ("_scale", "_growth_tracker")])  # fp16


def _classify(rec: Recorder) -> dict[str, int]:
    parts = dict.fromkeys(PART_LABELS, 0)
    for r in rec.live_at_peak():
        if "parameter" in r.tags:
            kind = "parameters"
        elif "gradient" in r.tags:
            kind = "gradients"
        elif "optimizer" in r.tags:
            kind = "optimizer_state"
        elif "autocast" in r.tags:
            kind = "autocast_copies"
        elif rec.span_kinds[r.span] in ("forward", "recompute") and rec.outlived_span(r):
            kind = "activations"
        else:
            kind = "temporaries"
        parts[kind] += r.nbytes
    return parts


def margin_of(device: Device) -> Margin:
    return getattr(device, "margin", None) or Margin()


def breakdown(model_file: ModelFile, plan: Plan, device: TrackedDevice, steps: int = 2, dist=None) -> MemoryBreakdown:
    """Run `plan` once on `device` (fake or cpu) with its budget lifted, recording every storage, and sort
    what was live at the peak. The step is the trial's own (run_trial), so the peak is the trial's peak. A plan
    on several ranks is measured on one of them (`dist`, or a fake world made for it)."""
    from .trial import run_trial  # trial imports step, which imports devices: keep this module light

    if not isinstance(device, TrackedDevice):
        raise OomtuneError(f"a memory breakdown needs the fake or cpu device, not {device.kind}")
    from .parallel import ranks_for

    with ranks_for(plan, device, dist) as d:
        return _breakdown(model_file, plan, device, steps, d, run_trial)


def _breakdown(model_file, plan, device, steps, dist, run_trial) -> MemoryBreakdown:
    tracker = device.tracker
    budget, tracker.budget_bytes = tracker.budget_bytes, None  # the breakdown of a plan that does not fit, too
    rec = Recorder(tracker)
    rec.on_op = _tag_autocast_copies
    tracker.recorder = rec
    try:
        result = run_trial(model_file, plan, device, steps, observe=lambda t, phase: _observe(rec, t, phase),
                           dist=dist)
    finally:
        tracker.recorder = None
        tracker.budget_bytes = budget
    if result.oom:  # only the host itself can run out now
        raise OomtuneError(f"the breakdown run of {plan.describe()} ran out of host memory: {result.oom_message}")
    parts = _classify(rec)
    margin = margin_of(device)
    return MemoryBreakdown(
        phase=rec.peak_phase, **{f"{k}_bytes": v for k, v in parts.items()}, tensor_peak_bytes=rec.peak_bytes,
        margin=margin.describe(), margin_bytes=margin.overhead(rec.peak_bytes),
    )


def breakdown_difference(old: MemoryBreakdown, new: MemoryBreakdown) -> dict[str, int]:
    """new - old per part, plus the tensor peak, the margin and the peak."""
    diff = {k: new.part_bytes()[k] - old.part_bytes()[k] for k in MemoryBreakdown.PARTS}
    diff["tensor_peak"] = new.tensor_peak_bytes - old.tensor_peak_bytes
    diff["margin"] = new.margin_bytes - old.margin_bytes
    diff["peak"] = new.peak_bytes - old.peak_bytes
    return diff


# -- when nothing fits: why, and what would help --------------------------------------------------

def why_nothing_fits(bd: MemoryBreakdown, plan: Plan, static: StaticMemory, limit_bytes: int, budget_bytes: int,
                     headroom: float, margin: Margin) -> str:
    allowed = f"{format_bytes(limit_bytes)} allowed ({format_bytes(budget_bytes)} budget, {headroom:.0%} headroom)"
    if margin.total(static.total_bytes) > limit_bytes:
        over = margin.overhead(static.total_bytes)
        plus = f" + margin {format_bytes(over)}" if over else ""
        return (f"weights + gradients + {static.optimizer_name} state = {format_bytes(static.total_bytes)}{plus} > "
                f"{allowed}, before a single activation")
    margin_text = f" + margin {format_bytes(bd.margin_bytes)}" if bd.margin_bytes else ""
    floor = bd.parameters_bytes + bd.gradients_bytes + bd.optimizer_state_bytes
    return (f"even {plan.describe()} peaks at {format_bytes(bd.peak_bytes)} > {allowed}: weights + gradients + "
            f"{static.optimizer_name} state {format_bytes(floor)}, the rest "
            f"{format_bytes(bd.peak_bytes - bd.margin_bytes - floor)}{margin_text} (peak in {bd.phase})")


def levers(bd: MemoryBreakdown, static: StaticMemory, limit_bytes: int, margin: Margin, headroom: float,
           checkpointing_used: bool) -> list[str]:
    """What would make the smallest plan fit, with the bytes each saves (estimates, not measurements)."""
    need = bd.peak_bytes - limit_bytes  # bytes to save, margin included
    tensor_room = margin.tensor_budget(limit_bytes)  # tensor bytes the limit allows
    out: list[str] = []

    def enough(saved_tensor_bytes: int) -> str:
        return "enough" if bd.tensor_peak_bytes - saved_tensor_bytes <= tensor_room else "not enough alone"

    opt = bd.optimizer_state_bytes
    if opt:
        saved = opt * 3 // 4
        out.append(f"8-bit optimizer state (bitsandbytes AdamW8bit): {static.optimizer_name} state "
                   f"{format_bytes(opt)} -> {format_bytes(opt - saved)}, saves {format_bytes(saved)} ({enough(saved)})")
        out.append(f"CPU offload of the optimizer state (DeepSpeed ZeRO-Offload, FSDP CPUOffload): saves "
                   f"{format_bytes(opt)} of GPU memory, costs host RAM and PCIe time ({enough(opt)})")
    sharded = bd.parameters_bytes + bd.gradients_bytes + opt
    rest = bd.tensor_peak_bytes - sharded
    if sharded and tensor_room > rest:
        n = max(2, math.ceil(sharded / (tensor_room - rest)))
        out.append(f"shard weights, gradients and optimizer state across {n} GPUs (FSDP / DeepSpeed ZeRO-3): "
                   f"{format_bytes(sharded)} -> {format_bytes(sharded // n)} per GPU")
    elif sharded:
        out.append("sharding across GPUs (FSDP / ZeRO-3) cannot help alone: activations and temporaries "
                   f"{format_bytes(rest)} already exceed what the limit leaves")
    act = bd.activations_bytes + bd.temporaries_bytes
    if act and act >= need:
        if not checkpointing_used:
            out.append("activation checkpointing: define blocks(model) in the model file so oomtune can wrap them")
        out.append(f"a shorter context (--min-context): activations + temporaries are {format_bytes(act)}")
    bigger = [g.name for g in GPUS if int(g.memory_bytes * (1 - headroom)) >= max(bd.peak_bytes, limit_bytes + 1)]
    if bigger:
        out.append(f"a larger GPU: {', '.join(bigger)}")
    return out


# -- estimate ------------------------------------------------------------------------------------

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
    from .probe import ladder_rungs, plan_of
    from .search import Point

    last = ladder_rungs(device, amp, checkpointing_supported, world_size, sharding)[-1]
    return plan_of(Point(last, 1, targets.min_context), world_size)


def check_estimate_options(objective: str, headroom: float) -> None:
    if objective == "throughput":
        raise OomtuneError("--objective throughput ranks rungs by measured speed, and the fake device computes "
                           "nothing; run `oomtune probe --objective throughput` where the model can run", BAD_INPUT)
    if not 0 <= headroom < 1:
        raise OomtuneError(f"--headroom must be in [0, 1), got {headroom}")


def estimate(model_file: ModelFile, device: FakeDevice, targets, *, headroom: float = 0.1, steps: int = 2,
             objective: str = "fit", amp: str = "auto", on_start: Callable | None = None,
             on_trial: Callable[[TrialRecord], None] | None = None, world_size: int = 1,
             sharding: str | None = None) -> EstimateResult:
    """The probe's ladder on the fake device, then the breakdown of its choice (see module doc).

    On `world_size` ranks the ladder runs in a fake process group (torch's `fake` backend: collectives do
    nothing) on rank 0, with FSDP2's own code: sharded weights, gradients and optimizer state, the units'
    gathered weights, full activations (DDP cannot wrap fake tensors: its reducer's buckets are added instead).
    `sharding` puts every rung on ddp or fsdp; by default the ladder replicates (ddp) and adds an fsdp rung."""
    from . import parallel

    check_estimate_options(objective, headroom)
    parallel.check_world(world_size, sharding)
    ranks = (parallel.fake_world(world_size) if world_size > 1 or sharding in ("ddp", "fsdp")
             else contextlib.nullcontext(None))
    with ranks as d:
        return _estimate(model_file, device, targets, headroom, steps, objective, amp, on_start, on_trial, d,
                         sharding)


def _estimate(model_file, device, targets, headroom, steps, objective, amp, on_start, on_trial, dist,
              sharding) -> EstimateResult:
    from .probe import ProbeResult, probe
    from .search import LadderResult

    world = dist.world_size if dist is not None else 1
    limit = int(device.budget_bytes * (1 - headroom))
    static = static_memory(model_file)
    sharded_by = world if sharding in (None, "fsdp") else 1
    if device.margin.total(static.total_bytes // sharded_by) > limit:
        # nothing can fit: skip the ladder (every trial would run out) and explain with the smallest plan
        search = ProbeResult(LadderResult((), None, ()), [], static, targets, limit, None, world_size=world)
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
    search.why_nothing_fits = why_nothing_fits(bd, plan, static, limit, device.budget_bytes, headroom, device.margin)
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


def what_if(model_file: ModelFile, plan: Plan, device: FakeDevice | None, margin: Margin, *, headroom: float = 0.1,
            steps: int = 2) -> WhatIf:
    """The breakdown of one plan; with a device (a budget), the verdict and levers too."""
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
          headroom: float | None = None, margin: str | None = None, steps: int = 2) -> CheckResult:
    """Re-measure the config's plan and say whether it still fits the config's budget (or --budget)."""
    from .trial import run_trial

    if device_kind not in CHECK_DEVICES:
        raise OomtuneError(f"--device {device_kind!r}: expected one of {', '.join(CHECK_DEVICES)}")
    fb = config.found_by
    headroom = headroom if headroom is not None else (fb.headroom if fb is not None else 0.1)
    if not 0 <= headroom < 1:
        raise OomtuneError(f"--headroom must be in [0, 1), got {headroom}")
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
    if device_kind == "fake":
        device: Device = FakeDevice(str(budget_bytes), gpu=spec, margin=check_margin(config, margin))
    elif device_kind == "cpu":
        device = CpuDevice(str(budget_bytes))
    else:
        device = make_device("cuda", str(budget_bytes))
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
                       None if r.oom else r.peak_bytes, old_bd, None, r.oom_message)
