"""`oomtune check`, the CI gate: re-measure a config's plan (fake device by default, or cpu, or the real GPU) and
say whether it still fits the config's budget, with the breakdown against the one the config recorded."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..config.schema import HEADROOM, TRIAL_STEPS, Config, FoundBy, MemoryBreakdown, Plan
from ..errors import OomtuneError
from ..levers.nf4_bnb import declared_note
from ..memory.breakdown import breakdown, static_memory
from ..memory.cards import GENERIC, GpuSpec, find_gpu
from ..memory.compiled import compile_notes
from ..memory.cuda_attention import kernel_notes
from ..memory.devices import CpuDevice, Device, FakeDevice, TrackedDevice, make_device
from ..memory.margin import AnyMargin, Margin, parse_margin
from ..model_file import ModelFile, own_compile_note
from ..units import card_budget, card_memory, format_bytes
from .options import check_headroom, check_steps
from .trial import computing_where_needed, run_trial

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
    notes: tuple[str, ...] = ()  # how it was measured, where the fake device could not
    measured_on: Device | None = field(default=None, repr=False, compare=False)  # the device (a memory snapshot's)

    @property
    def breakdown(self) -> MemoryBreakdown | None:
        """The plan's breakdown as measured now (fake and cpu)."""
        return self.new

    @property
    def difference(self) -> dict[str, int] | None:
        return breakdown_difference(self.old, self.new) if self.old is not None and self.new is not None else None


def check_margin(config: Config, margin: str | None, card: GpuSpec | None) -> AnyMargin | None:
    """--margin, else the flat margin the config was probed with beside a card or on fake tensors (found_by.margin),
    else the one it was estimated with (a card's: that of the card checked against, None), else the card's (None),
    else the default where the config's peak was a real GPU's, else none (a cpu probe's peak is tensors only:
    compare like with like)."""
    if margin is not None:
        return parse_margin(margin)
    fb = config.found_by
    if fb is not None and fb.margin is not None:
        return parse_margin(fb.margin)
    if fb is not None and fb.breakdown is not None and not fb.breakdown.margin.startswith("card:"):
        return parse_margin(fb.breakdown.margin)
    if card is not None:
        return None
    if fb is not None and fb.device == "cuda":
        return parse_margin(None)
    return Margin()


def card_of(config: Config, gpu: str | None) -> GpuSpec | None:
    """--gpu, else the card the config was found with (found_by.card; in configs from before it, the estimated
    card's name). A config probed on a real GPU: that card's rules (the table's, by name, else the generic ones)
    without a context, as its budget was the memory free once its own context existed."""
    if gpu is not None:
        return find_gpu(gpu)
    fb = config.found_by
    if fb is None:
        return None
    card = None
    for name in (fb.card, fb.gpu_name.removesuffix(" (estimated)") if fb.device in ("fake", "cuda") else None):
        try:
            card = find_gpu(name) if name else None
        except OomtuneError:  # a real GPU the table does not know (its card is named after the driver's name)
            continue
        if card is not None:
            break
    if fb.device != "cuda":
        return card
    return dataclasses.replace(card or GENERIC, context_bytes=0)


def check_budget(config: Config, budget: str | None, gpu: str | None, spec: GpuSpec | None) -> int:
    """--budget (a percentage of the card's memory, never more than it); else, with --gpu, that card's memory, as
    estimate's (the config's budget was the memory of the device it was found on); else the config's."""
    if budget is not None:
        return card_budget(budget, spec)
    if gpu is not None and spec is not None:
        return card_memory(spec, gpu)
    fb = config.found_by
    if fb is None:
        raise OomtuneError("the config has no found_by section to take the budget from: give --budget")
    memory = spec.memory_bytes if spec is not None and fb.device != "cuda" else None  # (a GPU's own may pass
    if memory is not None and fb.budget_bytes > memory:  # the table's by a little: ECC off, a variant)
        raise OomtuneError(f"the config's budget {format_bytes(fb.budget_bytes)} (found_by.budget_bytes) is more than "
                           f"the {spec.name}'s {format_bytes(memory)}: give --budget")
    return fb.budget_bytes


def check(config: Config, model_file: ModelFile, *, device_kind: str = "fake", budget: str | None = None,
          headroom: float | None = None, margin: str | None = None, steps: int = TRIAL_STEPS,
          gpu: str | None = None) -> CheckResult:
    """Re-measure the config's plan and say whether it still fits the config's budget (or --budget, or --gpu's
    memory: check_budget)."""
    if device_kind not in CHECK_DEVICES:
        raise OomtuneError(f"--device {device_kind!r}: expected one of {', '.join(CHECK_DEVICES)}")
    if margin is not None and device_kind == "cuda":  # it measures the real thing
        raise OomtuneError("--margin applies to the simulated devices (--device fake or cpu), not cuda")
    check_steps(steps)
    fb = config.found_by
    if headroom is not None:
        check_headroom(headroom)
    elif fb is not None:
        headroom = fb.headroom
        check_headroom(headroom, "the config's found_by.headroom")
    else:
        headroom = HEADROOM
    if gpu is not None and device_kind == "cuda":
        raise OomtuneError(f"--gpu {gpu} is for the simulated devices (--device fake or cpu): cuda is the card itself")
    spec = card_of(config, gpu) if device_kind != "cuda" else None
    budget_bytes = check_budget(config, budget, gpu, spec)
    clamped_from = None
    if device_kind == "fake":
        device: Device = FakeDevice(str(budget_bytes), gpu=spec, margin=check_margin(config, margin, spec))
    elif device_kind == "cpu":
        device = CpuDevice(str(budget_bytes), card=spec, margin=check_margin(config, margin, spec))
    else:
        device, clamped_from = _cuda_device(budget_bytes, clamp=budget is None)
        budget_bytes = device.budget_bytes
    limit = int(budget_bytes * (1 - headroom))
    if budget is not None or gpu is not None:  # (the config's own budget: a model grown past it no longer fits)
        tensors = device.tensor_budget(limit) if isinstance(device, TrackedDevice) else limit  # less the margin
        check_floor(model_file, config.plan, device.kind, budget_bytes, tensors, headroom)
    old_peak, old_bd, versions = *recorded_for(fb, config.plan), version_notes(fb)
    if isinstance(device, TrackedDevice):
        kernel_notes(), compile_notes()  # (earlier trials' choices in this process)
        bd, computed = computing_where_needed(device, model_file.label,
                                              lambda: breakdown(model_file, config.plan, device, steps))
        computed += kernel_notes() + compile_notes()
        from .estimate import no_bf16_note

        own = static_memory(model_file).compiled and device.kind != "cuda"  # (on cuda torch.compile itself runs)
        notes = ((own_compile_note(model_file.label, device.kind),) if own else ()) + declared_note(model_file)
        notes += tuple(n for n in (no_bf16_note(device, config.plan.precision),) if n)
        return CheckResult(bd.peak_bytes <= limit, config.plan, device.kind, budget_bytes, headroom, limit,
                           old_peak, bd.peak_bytes, old_bd, bd, notes=notes + computed + versions, measured_on=device)
    r = run_trial(model_file, config.plan, device, steps)
    fits = not r.oom and r.peak_bytes is not None and r.peak_bytes <= limit
    return CheckResult(fits, config.plan, device.kind, budget_bytes, headroom, limit, old_peak,
                       None if r.oom else r.peak_bytes, old_bd, None, r.oom_message, clamped_from, versions,
                       measured_on=device)


def recorded_for(fb: FoundBy | None, plan: Plan) -> tuple[int | None, MemoryBreakdown | None]:
    """found_by's peak and breakdown, where they are `plan`'s: a trial of found_by fitted at its micro-batch,
    context, accumulation, precision and checkpointing (a file without trials, from an older oomtune, is taken at
    its word). None, None where none did: train's out-of-memory fallback rewrote the plan, or a person edited it,
    and the recorded peak was another plan's."""
    if fb is None:
        return None, None
    key = lambda r: (r.micro_batch_size, r.context_length, r.grad_accum_steps, r.precision,  # noqa: E731
                     r.activation_checkpointing)
    if not fb.trials or any(r.result == "fits" and key(r) == key(plan) for r in fb.trials):
        return fb.peak_bytes, fb.breakdown
    return None, None


def version_notes(fb: FoundBy | None) -> tuple[str, ...]:
    """A note where the config was found with another release of torch or oomtune than this check runs: a peak
    that moved may be theirs (a kernel, an allocator, the accounting), not the model's."""
    import torch

    from .. import __version__

    if fb is None:
        return ()
    changed = [f"{name} {then} (now {now})" for name, then, now in (
        ("torch", fb.torch_version, str(torch.__version__)), ("oomtune", fb.oomtune_version, __version__))
        if then.split("+")[0] != now.split("+")[0]]  # (a CUDA and a CPU build of one torch: the same release)
    if not changed:
        return ()
    return (f"the config was found with {' and '.join(changed)}: where the peak moved, the versions may have moved "
            "it, not the model",)


def check_floor(model_file: ModelFile, plan: Plan, kind: str, budget_bytes: int, limit: int,
                headroom: float) -> None:
    """A budget the user gave (--budget, --gpu's memory) whose tensor `limit` (less the headroom and the device's
    margin) the plan's weights, gradients and optimizer state alone exceed is bad input (exit 2), as for probe and
    estimate; on cuda the real run says so itself."""
    if kind == "cuda":
        return
    levers = [name for name, on in (("bf16-true", plan.precision == "bf16-true"), ("8-bit AdamW", plan.optimizer_8bit),
                                    ("optimizer offload", plan.offload_optimizer),
                                    ("NF4 weights", plan.nf4_frozen_weights),
                                    ("chunked cross-entropy", plan.chunked_loss),
                                    ("optimizer in backward", plan.optimizer_in_backward),
                                    ("compiled", plan.compile)) if on]
    static = static_memory(model_file, plan, " + ".join(levers))
    if static.floor_bytes > limit:
        less = [f"{headroom:.0%} headroom"] * bool(headroom) + \
            ["the margin (a card's context and workspaces)"] * (limit < int(budget_bytes * (1 - headroom)))
        after = f" ({format_bytes(limit)} for tensors, after {' and '.join(less)})" if less else ""
        raise OomtuneError(f"budget {format_bytes(budget_bytes)}{after} is too small for the plan's weights alone: "
                           f"{static.describe()}")


def _cuda_device(budget_bytes: int, clamp: bool) -> tuple[Device, int | None]:
    """The GPU under `budget_bytes`. With `clamp` (no --budget: the config's, which was the free memory when it
    was probed) at most what is free now, and the config's budget when that was more (None when it was not)."""
    if not clamp:
        return make_device("cuda", str(budget_bytes)), None
    device = make_device("cuda")  # no budget: all that is free now
    free = device.budget_bytes
    device.lower_budget(budget_bytes)
    return device, (budget_bytes if free < budget_bytes else None)


def breakdown_difference(old: MemoryBreakdown, new: MemoryBreakdown) -> dict[str, int]:
    """new - old per part, plus the tensor peak, the margin and the peak."""
    diff = {k: new.part_bytes()[k] - old.part_bytes()[k] for k in MemoryBreakdown.PARTS}
    diff["tensor_peak"] = new.tensor_peak_bytes - old.tensor_peak_bytes
    diff["margin"] = new.margin_bytes - old.margin_bytes
    diff["peak"] = new.peak_bytes - old.peak_bytes
    return diff

