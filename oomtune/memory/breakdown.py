"""What the peak is made of.

`static_memory`: the floor under every plan (weights, gradients, optimizer state), measured on fake tensors
so it costs no memory and works for a model far bigger than the machine.

`breakdown`: one run of a plan on a tracked device (fake or cpu) with a Recorder on the tracker, sorting
every storage live at the peak into parameters, gradients, optimizer state, autocast weight copies,
activations and temporaries. The parts sum to the tensor peak exactly, because they are the live set at
the moment of the peak, not a model of it."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..checkpointing import (
    blocks_that_run,
    calls_checkpoint,
    cannot_checkpoint,
    checkpoints_itself,
    describe_blocks,
    hf_checkpointing,
    repeated_runs,
    runs_cut,
)
from ..config.schema import TRIAL_STEPS, MemoryBreakdown, Plan
from ..dist.group import LOCAL, Dist, ranks_for
from ..errors import OomtuneError
from ..hook_names import check_first_loss
from ..levers.chunked_loss import causal_lm_loss
from ..levers.chunked_loss import why_not as chunked_why_not
from ..model_file import ModelFile, is_compiled
from ..step import as_on_cuda, release_tensor_hooks, steps_in_backward
from ..units import format_bytes
from .devices import FakeDevice, TrackedDevice
from .fakes import real_code_paths
from .host_kernels import has_lstm
from .layer_drop import layer_drop_note
from .life_kinds import run_kinds
from .on_host import CudaOnHost
from .recorder import Recorder
from .tracker import MemoryTracker, storage_key


@dataclass(frozen=True)
class StaticMemory:
    """Bytes that live through a whole step no matter the batch: the floor under every plan."""

    weights_bytes: int  # parameters and buffers
    gradients_bytes: int
    optimizer_bytes: int  # optimizer state after its first step (AdamW: two moments per parameter)
    optimizer_name: str
    checkpointing_supported: bool
    compiled: bool = False  # build_model() returns a torch.compile'd model
    step_temporaries_bytes: int = 0  # the optimizer step's own scratch at its peak (foreach AdamW: a few per param)
    nf4_elements: int = 0  # elements of frozen Linear weights the NF4 lever can store in 4 bits
    host_bytes: int = 0  # what the plan's offload levers hold in host memory instead
    levers: str = ""  # the levers past accumulation this was measured with ("" for none)
    weights_dtype: str | None = None  # "bfloat16" / "float16": every trained weight is built in it (else None)
    trained_sizes: tuple[int, ...] = ()  # elements of each trained parameter
    batch_norm: bool = False  # the model has BatchNorm layers (their statistics are a micro-batch's)
    checkpoints_itself: str | None = None  # how build_model() turned the model's own checkpointing on: no such rung
    lstm: bool = False  # the model has an nn.LSTM (memory/host_kernels.py: some CPUs cannot autocast it)
    checkpointing_breaks: str | None = None  # why the model cannot train checkpointed (cannot_checkpoint): no rung
    frozen_dtype: str | None = None  # "bfloat16" / "float16": every frozen weight is, where the trained ones are not
    layer_drop: str | None = None  # the note for a model that skips layers at random (layer_drop.py), else None
    checkpointing_via: str | None = None  # "switch" (the model's own: Hugging Face's) | "blocks" (wrapped) | None
    checkpointing_idle: str | None = None  # the blocks checkpointing would wrap, where a forward runs none: no rung
    blocks_wrapped: str | None = None  # the blocks checkpointing wraps, described ("8 blocks (MLP x4, ...)"), else None
    optimizer_blocks: tuple[tuple[str, str], ...] = ()  # (plan key, why): levers its optimizer() bars (own_optimizer)
    declared_4bit: str | None = None  # the 4-bit weights the model declares (a BitsAndBytesConfig: nf4_bnb), or None
    chunked_loss_why: str | None = "not measured"  # why the chunked-loss lever cannot compute this model's loss (None:
    # it can: levers/chunked_loss.why_not)
    steps_in_backward: int = 0  # trained parameters with post-accumulate-grad hooks (an optimizer stepped in backward):
    # their gradients may never reach the optimizer, so none of them, its state or its step count in the floor
    repeated_blocks: tuple | None = None  # the model as built (plan None): (the class of the blocks it repeats, the
    # length of their stack, where their run starts) (checkpointing.repeated_runs), None where it repeats none
    bf16_weights_bytes: int = 0  # the model as built (plan None): its weights cast to bf16, a bound under bf16-true's

    @property
    def trained_elements(self) -> int:
        return sum(self.trained_sizes)

    def moment_bytes(self, precision: str = "fp32", eight_bit: bool = False) -> int:
        """AdamW's two moments on a plan of `precision`, each tensor 512-byte rounded: in the weights' dtype (bf16
        where they are: bf16-true, a model built in bf16; else fp32). `eight_bit`: 8-bit AdamW's, a byte each and a
        4-byte scale per 256 elements where it quantizes, plain moments elsewhere (a tensor under 4096 elements:
        LoRA's adapters often are), as torchao keeps them."""
        from ..levers.adamw8bit import BLOCK, quantizes
        from .allocator import rounded

        size = 2 if precision == "bf16-true" or self.weights_dtype is not None else 4
        return sum(2 * (rounded(n) + rounded(n // BLOCK * 4)) if eight_bit and quantizes(n) else 2 * rounded(n * size)
                   for n in self.trained_sizes)

    @property
    def total_bytes(self) -> int:
        """What lives through every step: weights, gradients, optimizer state."""
        return self.weights_bytes + self.gradients_bytes + self.optimizer_bytes

    @property
    def floor_bytes(self) -> int:
        """The least any plan peaks at: all that lives through a step, plus the optimizer step's temporaries."""
        return self.total_bytes + self.step_temporaries_bytes

    def describe(self) -> str:
        extra = [f"with {self.levers}"] if self.levers else []
        extra += [f"and {format_bytes(self.host_bytes)} in host memory"] if self.host_bytes else []
        extra += ([f"{self.steps_in_backward} parameters stepped in backward by their own hooks: their gradients "
                   "and optimizer state not counted"] if self.steps_in_backward else [])
        scratch = (f" + the optimizer step's temporaries {format_bytes(self.step_temporaries_bytes)}"
                   if self.step_temporaries_bytes else "")  # (none: fused AdamW, the default)
        return (f"weights {format_bytes(self.weights_bytes)} + gradients {format_bytes(self.gradients_bytes)} + "
                f"{self.optimizer_name} state {format_bytes(self.optimizer_bytes)}{scratch} = "
                f"{format_bytes(self.floor_bytes)}"
                + (f" ({'; '.join(extra)})" if extra else ""))


class _Ledger:
    """What the levers ask of a device (`host()`, pinning, synchronize), over static_memory's own tracker."""

    kind = FakeDevice.kind
    pin_memory = False

    def __init__(self, tracker: MemoryTracker):
        self.tracker = tracker

    def host(self):
        return self.tracker.hosting()

    def synchronize(self) -> None:
        pass


def static_memory(model_file: ModelFile, plan: Plan | None = None, levers: str = "", *,
                  checks: bool = True) -> StaticMemory:
    """Build the model on fake tensors, give every parameter a gradient and take one optimizer step,
    counting bytes after each stage (512-byte rounded, like the CUDA allocator), and the step's own peak.
    With a `plan`, its levers past accumulation (named `levers`) applied as training applies them: bf16-true and
    NF4 weights, 8-bit AdamW state, the optimizer and its gradients offloaded (counted as host memory).
    `checks=False`: the bytes only (a rung's floor): how the model checkpoints, which needs forwards, is not found
    (checkpointing_supported False)."""
    from ..levers import four_bit_of, make_optimizer, prepare_model
    from ..levers.nf4 import frozen_linears
    from ..levers.own_optimizer import blocked_levers

    tracker = MemoryTracker()
    with FakeTensorMode(allow_non_fake_inputs=True), real_code_paths(tracker=tracker), tracker, torch.device("cpu"):
        with CudaOnHost():
            model = model_file.build()
        nf4 = 0 if (four_bit := four_bit_of(model_file, plan)) else sum(w.weight.numel() for w in frozen_linears(model))
        runs = repeated_runs(model) if plan is None else []
        bf16 = _bf16_weights(model) if plan is None else 0
        repeats = (type(runs[0][0][-1]), len(runs[0][0]), runs[0][1]) if runs else None
        low, frozen = (_low_dtype(p for p in model.parameters() if p.requires_grad is trained)
                       for trained in (True, False))
        frozen = frozen if low is None else None  # (a whole model in 16 bits: the weights_dtype note says it)
        stepping = steps_in_backward(model)
        chunked_why = chunked_why_not(model_file.label, model_file.has("loss"), causal_lm_loss(model))
        if plan is not None or four_bit:
            prepare_model(model, plan, model_file.label, computes=False, four_bit=four_bit)
        weights = tracker.live_bytes
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt = (make_optimizer(model_file, params, 1e-3, model, plan, _Ledger(tracker)) if plan is not None
               else model_file.optimizer(params, 1e-3, model))
        own = blocked_levers(opt) if plan is None and model_file.has("optimizer") else ()
        if hasattr(opt, "take_gradients"):  # offloaded: what backward's hooks do as each gradient is made
            opt.take_gradients()
        grads = tracker.live_bytes - weights
        as_on_cuda(opt, FakeDevice.kind)  # foreach, as torch runs it on a GPU
        tracker.reset_peak()
        opt.step()
        optimizer_state = tracker.live_bytes - weights - grads
        temporaries = tracker.peak_bytes - tracker.live_bytes
        if stepping:  # a lower bound: what the model file's hooks leave of gradients and state is theirs to say
            grads = optimizer_state = temporaries = 0
        if plan is not None and plan.optimizer_in_backward:  # each gradient applied and freed as backward makes it,
            grads = temporaries = 0  # each hook stepping one parameter (a lower bound: its one's scratch left out)
        hooked = model_file.has("blocks") or not checks  # (a blocks hook always gets the rung)
        itself = None if hooked else checkpoints_itself(model) or calls_checkpoint(  # its own checkpoint() calls too
            model, functools.partial(_first_forward, model_file, model))
        breaks = None if hooked else cannot_checkpoint(model)
        checkpointing = checks and model_file.supports_checkpointing(model) and not itself and not breaks
        via = ("blocks" if hooked or hf_checkpointing(model) is None else "switch") if checkpointing else None
        wrapped, idle = _wrapped_blocks(model_file, model) if via == "blocks" else (None, None)
        checkpointing, via = (False, None) if idle else (checkpointing, via)
        name = type(getattr(opt, "inner", opt)).__name__
        compiled = is_compiled(model)
        host = tracker.host_live_bytes
        trained = tuple(p.numel() for p in params)
        batch_norm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
        lstm = has_lstm(model)
        drops = layer_drop_note(model_file.label, model)
        if plan is None:  # the default loss's first mistakes, before any trial
            with CudaOnHost():
                check_first_loss(model_file, model, functools.partial(_first_batch, model_file),
                                 functools.partial(runs_cut, runs) if runs else None)  # (on 2 of its blocks)
        release_tensor_hooks(model)
        del model, params, opt
    return StaticMemory(weights, grads, optimizer_state, name, checkpointing, compiled, temporaries, nf4, host,
                        levers, low, trained, batch_norm, itself, lstm, breaks, frozen_dtype=frozen,
                        layer_drop=drops, checkpointing_via=via, checkpointing_idle=idle, blocks_wrapped=wrapped,
                        optimizer_blocks=own, steps_in_backward=stepping, chunked_loss_why=chunked_why,
                        repeated_blocks=repeats, bf16_weights_bytes=bf16, declared_4bit=four_bit and four_bit.name)


def _bf16_weights(model: torch.nn.Module) -> int:
    """The weights' bytes as `.to(torch.bfloat16)` leaves them (a tensor it casts: a copy of its elements at 2 bytes;
    another: its storage once), 512-byte rounded: a bound under a bf16-true build's (RungFloors.at_least)."""
    from .allocator import rounded
    sizes = {}
    for t in (*model.parameters(), *model.buffers()):
        if (key := storage_key(t)) is not None:  # (not a wrapper subclass's)
            if (t.is_floating_point() or t.is_complex()) and t.dtype != torch.bfloat16:
                sizes[key, t.storage_offset(), t.shape, t.stride()] = rounded(t.numel() * 2)
            else:
                sizes[key] = rounded(t.untyped_storage().nbytes())
    return sum(sizes.values())


def _wrapped_blocks(model_file: ModelFile, model: torch.nn.Module) -> tuple[str, str | None]:
    """(what checkpointing wraps, described; the same where a first forward runs none of it: a rung that would save
    nothing, else None)."""
    blocks = model_file.blocks(model)
    ran = blocks_that_run(blocks, functools.partial(_first_forward, model_file, model))
    return describe_blocks(blocks), describe_blocks(blocks) if ran == 0 else None


def _low_dtype(params) -> str | None:
    """"bfloat16" / "float16" where every floating-point one of `params` is in it (and there is one), else None."""
    dtypes = {p.dtype for p in params if p.is_floating_point()}
    return str(dtypes.pop()).removeprefix("torch.") if dtypes in ({torch.float16}, {torch.bfloat16}) else None


def _first_forward(model_file: ModelFile, model: torch.nn.Module) -> None:
    """One forward and loss at micro-batch 1 and a short context, in training mode (on the caller's fake tensors)."""
    model.train()
    with CudaOnHost():
        model_file.loss(model, _first_batch(model_file))


def _first_batch(model_file: ModelFile):
    """make_batch at micro-batch 1 and a short context (on the caller's fake tensors)."""
    with CudaOnHost():
        return model_file.batch(1, min(model_file.defaults.get("context", 16), 64), torch.device("cpu"))


PART_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "autocast_copies": "autocast weight copies",
    "activations": "saved activations",
    "temporaries": "temporaries",
}


def optimizer_help(plan: Plan, name: str | None) -> str:
    """PART_HELP's optimizer line for `plan` and the optimizer's class name (None: the default AdamW)."""
    if plan.optimizer_8bit:
        return "8-bit moments, a scale/256"
    if name in (None, "AdamW", "Adam"):
        return PART_HELP["optimizer_state"]
    return f"{name}'s state"


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


def kind_of(rec: Recorder, r) -> str:
    """The part of the breakdown a recorded storage belongs to."""
    for tag, kind in (("parameter", "parameters"), ("gradient", "gradients"), ("optimizer", "optimizer_state"),
                      ("autocast", "autocast_copies")):
        if tag in r.tags:
            return kind
    if rec.span_kinds[r.span] in ("forward", "recompute") and rec.outlived_span(r):
        return "activations"
    return "temporaries"


def _classify(rec: Recorder) -> dict[str, int]:
    parts = dict.fromkeys(PART_LABELS, 0)
    for r in rec.live_at_peak():
        parts[kind_of(rec, r)] += r.nbytes
    return parts


def breakdown(model_file: ModelFile, plan: Plan, device: TrackedDevice, steps: int = TRIAL_STEPS,
              dist: Dist = LOCAL) -> MemoryBreakdown:
    """Run `plan` once on `device` (fake or cpu) with its budget lifted, recording every storage, and sort
    what was live at the peak. The step is the trial's own (run_trial), so the peak is the trial's peak. A plan
    on several ranks is measured on one of them (`dist`, or a fake world made for it)."""
    from ..search.trial import run_trial  # trial imports step, which imports devices: keep this module light

    if not isinstance(device, TrackedDevice):
        raise OomtuneError(f"a memory breakdown needs the fake or cpu device, not {device.kind}")
    with ranks_for(plan, device, dist) as d:
        result, bd = recorded_trial(model_file, plan, device, steps, d, run_trial, lift_budget=True)
    if bd is None:  # only the host itself can run out now
        raise OomtuneError(f"the breakdown run of {plan.describe()} ran out of host memory: {result.oom_message}")
    return bd


def snapshot(model_file: ModelFile, plan: Plan, device: TrackedDevice, steps: int = TRIAL_STEPS) -> dict:
    """One trial of `plan` (its budget lifted) as the memory viewer's snapshot (snapshot.py)."""
    from ..search.trial import run_trial
    from .snapshot import from_recorder

    with ranks_for(plan, device, LOCAL) as d:
        _, rec = _recorded(model_file, plan, device, steps, d, run_trial, lift_budget=True, stacks=True)
    return from_recorder(rec, kind_of)


def recorded_trial(model_file, plan, device, steps, dist, run_trial, lift_budget: bool = False) -> tuple:
    """`run_trial` with a Recorder on the device's tracker: (the trial's result, the breakdown of its peak, or
    None where it ran out). `lift_budget`: measure a plan that does not fit, too. A traced trial's result has the
    parts of its lives too (`kinds`, life_kinds.py), where they could be told."""
    result, rec = _recorded(model_file, plan, device, steps, dist, run_trial, lift_budget)
    if result.oom:
        return result, None
    parts, phase, peak = _classify(rec), rec.peak_phase, rec.peak_bytes
    kinds = None
    if result.second_step_made:  # (the recorder saw the first step: the made peak's parts from its records)
        if rec.made is None or rec.made[2] != result.peak_allocated_bytes:
            return result, None
        (parts, phase, peak), kinds = rec.made, rec.kinds
    elif result.trace is not None:
        kinds = run_kinds(result.trace, [k for k, _ in device.traced_from[0]], rec.records, lambda r: kind_of(rec, r))
    return replace(result, kinds=kinds), breakdown_of(parts, phase, peak, result, device.margin)


def breakdown_of(parts: dict[str, int], phase: str, peak: int, result, margin) -> MemoryBreakdown:
    """The breakdown of a trial's peak (`result`, a TrialResult) from what was live at it: `parts` (bytes per
    part, any left out being 0), the `phase` it was in, the tensor `peak`; `margin`: the device's."""
    lines = margin.fixed_lines()
    return MemoryBreakdown(
        phase=phase, **{f"{k}_bytes": v for k, v in {**dict.fromkeys(PART_LABELS, 0), **parts}.items()},
        tensor_peak_bytes=peak, margin=margin.describe(),
        margin_bytes=margin.overhead(peak, result.modelled_reserved_bytes), host_bytes=result.host_peak_bytes,
        modelled_reserved_bytes=result.modelled_reserved_bytes, context_bytes=lines.get("context", 0),
        workspace_bytes=lines.get("workspaces", 0), step_peak_bytes=result.step_peak_bytes)


def _recorded(model_file, plan, device, steps, dist, run_trial, lift_budget: bool, stacks: bool = False) -> tuple:
    """(the trial's result, the Recorder that saw it; `stacks`: with each birth's Python frames)."""
    tracker = device.tracker
    budget = tracker.budget_bytes
    if lift_budget:
        tracker.budget_bytes = None
    tracker.recorder = Recorder(tracker)
    tracker.recorder.on_op = _tag_autocast_copies
    tracker.recorder.stacks = stacks
    try:  # (the trial may restart the recorder: a rerun trial is recorded anew)
        result = run_trial(model_file, plan, device, steps,
                           observe=lambda t, phase: _observe(tracker.recorder, t, phase), dist=dist)
        rec = tracker.recorder
    finally:
        tracker.recorder = None
        tracker.budget_bytes = budget
    return result, rec
