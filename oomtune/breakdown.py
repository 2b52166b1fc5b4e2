"""What the peak is made of.

`static_memory`: the floor under every plan (weights, gradients, optimizer state), measured on fake tensors
so it costs no memory and works for a model far bigger than the machine.

`breakdown`: one run of a plan on a tracked device (fake or cpu) with a Recorder on the tracker, sorting
every storage live at the peak into parameters, gradients, optimizer state, autocast weight copies,
activations and temporaries. The parts sum to the tensor peak exactly, because they are the live set at
the moment of the peak, not a model of it. When nothing fits: why, and the levers that would help.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .devices import Device, TrackedDevice
from .errors import OomtuneError
from .gpus_table import GPUS, Margin
from .memtrack import MemoryTracker, Recorder
from .model_file import ModelFile
from .plan import TRIAL_STEPS, MemoryBreakdown, Plan
from .units import format_bytes


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


def breakdown(model_file: ModelFile, plan: Plan, device: TrackedDevice, steps: int = TRIAL_STEPS,
              dist=None) -> MemoryBreakdown:
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
