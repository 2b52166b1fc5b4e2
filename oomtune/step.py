"""The one training step. The probe's trials and the trainer both call `train_step`; nothing else may
re-implement it, so what the probe measured is what training uses.

One step = grad_accum_steps micro-steps (forward under autocast, loss / grad_accum_steps, scaled
backward through checkpointed blocks) + one optimizer step (unscale, clip, GradScaler step, zero_grad
with set_to_none=True so gradient memory is freed between steps).

On several ranks (plan.sharding ddp / fsdp) the model is wrapped by `dist.wrap.wrap`, each micro-step runs in
`micro_step` (no gradient sync except where the plan's sharding needs it), and the ranks agree on an
out-of-memory error before the optimizer step (`Dist.agreed`), so they all take the same decision. One process
has the LOCAL Dist, whose agreements and collectives do nothing: the step is the same code either way.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .config.schema import Plan
from .dist.group import LOCAL, Dist
from .dist.wrap import micro_step, sync_gradients, unwrapped, wrap
from .errors import BAD_INPUT, OomtuneError
from .levers import (
    build_model,
    cast_inputs,
    check_plan_runs,
    gradient_holders,
    in_backward,
    make_optimizer,
    saved_activations,
)
from .levers.chunked_loss import check_applies, chunk_cross_entropy, chunked_loss
from .levers.compile import PER_BLOCK, compile_model, compiled, compiled_by_the_model_file, trace_own_compile
from .memory import made_optim
from .memory.devices import Device, is_oom
from .model_file import Batch, ModelFile, ModelFileError
from .rank_allocation import after_optimizer_step, allocator_of

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "bf16-true": torch.bfloat16}


@dataclass
class Training:
    """Everything a step needs, built once per trial or per training run."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    plan: Plan
    model_file: ModelFile
    device: Device
    clip_grad_norm: float | None = None
    on_phase: Callable[[str], None] | None = None  # told "forward" / "backward" / "optimizer" as each starts
    dist: Dist = LOCAL  # the ranks (LOCAL: one process)
    decaying: tuple[float, ...] = ()  # per param group: the weight decay it was built with (set_weight_decay sets
    # those above 0)
    micro_losses: torch.Tensor | None = None  # the step in flight's micro-batch losses, each from its backward on
    rank_allocator: nn.Module | None = None  # PEFT AdaLoRA's, called after each optimizer step (rank_allocation.py)
    steps_in_backward: int = 0  # parameters stepped in backward: the model file's own hooks or optimizer_in_backward
    chunk_loss: Callable = chunk_cross_entropy  # a slice's loss under plan.chunked_loss (compiled: plan.compile)
    last_of_trial: bool = False  # the step is a trial's last: on fake tensors its optimizer step may be made, its
    # state's values unknown after (memory/made_optim.py)

    @property
    def module(self) -> nn.Module:
        """The model itself, not its DDP wrapper (state dicts, parameter lists)."""
        return unwrapped(self.model)

    def phase(self, name: str) -> None:
        if self.on_phase is not None:
            self.on_phase(name)


def build_training(model_file: ModelFile, plan: Plan, device: Device, lr: float,
                   clip_grad_norm: float | None = None, weight_decay: float | None = None,
                   dist: Dist = LOCAL, model: nn.Module | None = None) -> Training:
    """Build the model on the device, wrap its blocks for checkpointing, wrap it for the plan's sharding (DDP or
    FSDP2 over `dist`'s ranks), make the optimizer and scaler. `model`: one built (and checkpoint-wrapped) for an
    earlier trial of this plan's rung, reused as it is (one process only); the optimizer and scaler are new."""
    if plan.sharding != "none" and (not dist.grouped or dist.world_size != plan.world_size):
        have = f"{dist.world_size} ranks" if dist.grouped else "no process group"
        raise OomtuneError(f"plan is {plan.sharding} on {plan.world_size} ranks but this process has {have}")
    check_plan_runs(plan, device.kind)

    def build() -> nn.Module:
        return build_model(model_file, plan, device)  # on the device, its weights as the plan's levers store them

    if model is None:
        model = dist.agreed(build) if plan.sharding != "none" else build()  # before any collective
        own = device.kind != "cuda" and compiled_by_the_model_file(model)  # build_model's own torch.compile
        traced = trace_own_compile(model_file, model, per_block=plan.compile) if own else None  # (as --compile's)
        if plan.compile and not own:
            compile_model(model_file, model, device.kind)
        if plan.activation_checkpointing:  # (around the compiled blocks)
            model_file.enable_checkpointing(model, wrap=(plan.compile and not own) or traced == PER_BLOCK)
    model.train()
    if plan.chunked_loss:
        check_applies(model_file, model)
    allocator = allocator_of(model)
    if allocator is not None and plan.sharding == "fsdp":
        raise OomtuneError(f"plan.sharding fsdp: {model_file.label}'s AdaLoRA adapters reallocate their ranks from "
                           "scores over the whole model, and FSDP gives each rank a shard of them: use sharding ddp")
    if plan.sharding != "none":
        model = wrap(model, plan.sharding, model_file.blocks(model), dist)
    in_backward.take_off(model.parameters())  # a kept model's, from a trial of that lever: not the model file's own
    stepping = steps_in_backward(unwrapped(model))  # (before make_optimizer: offload hooks every parameter too)
    if stepping and plan.grad_accum_steps > 1:
        raise OomtuneError(f"plan.grad_accum_steps is {plan.grad_accum_steps}, but {model_file.label} steps "
                           f"{stepping} trained parameters in backward with its own post-accumulate-grad hooks: every "
                           "micro-batch's backward would update them (use 1)", BAD_INPUT)
    if plan.optimizer_in_backward:
        in_backward.check_applies(model_file.label, clip_grad_norm, stepping, allocator is not None)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(model_file, trained, lr, unwrapped(model), plan,
                               device)  # the 8-bit and offload levers replace the default AdamW
    as_on_cuda(optimizer, device.kind)
    if plan.optimizer_in_backward:
        in_backward.check_optimizer(optimizer, model_file.label)
        stepping += in_backward.put_on(optimizer, trained)
    t = Training(model, optimizer, _scaler(plan, device), plan, model_file, device, clip_grad_norm,
                 dist=dist, decaying=tuple(float(g.get("weight_decay") or 0) for g in optimizer.param_groups),
                 rank_allocator=allocator, steps_in_backward=stepping)
    if plan.compile and plan.chunked_loss:
        t.chunk_loss = compiled("a slice of the chunked loss", chunk_cross_entropy, device.kind)
    if weight_decay is not None:
        set_weight_decay(t, weight_decay)
    return t


def as_on_cuda(optimizer: torch.optim.Optimizer, device_kind: str) -> None:
    """Where the model file leaves torch to choose, torch runs an optimizer as `foreach` (one kernel over all its
    tensors) on CUDA and per tensor on the CPU; foreach AdamW holds a parameter-sized set of temporaries in the
    optimizer step (sqrt of the second moments for every tensor at once). The simulated devices stand in for a
    GPU, so they make CUDA's choice and their peak includes those temporaries. Again after a checkpoint's optimizer
    state is loaded: its groups bring the choice of the run that wrote it."""
    if device_kind == "cuda" or getattr(optimizer, "host_resident", False):  # torch chooses for itself there
        return
    for group in optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None and not group.get("fused") \
                and not group.get("differentiable"):
            group["foreach"] = True


def set_weight_decay(t: Training, weight_decay: float) -> None:
    """Set the decay of every param group the optimizer built with one (a group the model file made without
    decay - norms, biases - keeps none). Again after a checkpoint's optimizer state is loaded: it brings its
    groups' old values."""
    for group, decays in zip(t.optimizer.param_groups, t.decaying, strict=True):
        if decays:
            group["weight_decay"] = weight_decay


def _scaler(plan: Plan, device: Device) -> torch.amp.GradScaler:
    # a GradScaler only does anything for fp16: bf16 has fp32's range
    scaler = torch.amp.GradScaler(device.autocast_device_type, enabled=plan.precision == "fp16")
    if plan.sharding == "fsdp" and plan.precision == "fp16":  # each rank sees only its shard's overflow
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler(device.autocast_device_type)
    return scaler


def autocast(t: Training) -> contextlib.AbstractContextManager:
    if t.plan.precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(t.device.autocast_device_type, dtype=DTYPES[t.plan.precision])


def loss_of(t: Training, batch: Batch) -> torch.Tensor:
    """The micro-batch's loss: the model file's, or, under plan.chunked_loss, a causal LM's in slices."""
    if t.plan.chunked_loss:  # (the forward's saved tensors offloaded, not the output layer's and loss's)
        return chunked_loss(t.model_file, t.model, cast_inputs(batch, t.plan), t.chunk_loss,
                            lambda: saved_activations(t.plan, t.device))
    with saved_activations(t.plan, t.device):
        return t.model_file.loss(t.model, cast_inputs(batch, t.plan))


def _accumulate(t: Training, micro_batches: Sequence[Batch], weights: Sequence[float] | None) -> torch.Tensor:
    """-> each micro-batch's loss, in one tensor (one block, in training as in a trial: the trainer's check for a
    non-finite loss reads them, where a tensor kept per micro-batch put training above the trial's peak)."""
    n = len(micro_batches)
    losses = torch.zeros(n, device=t.device.torch_device)
    for i, batch in enumerate(micro_batches):
        with micro_step(t.model, t.plan.sharding, last=i == n - 1):
            t.phase("forward")
            with autocast(t):
                loss = loss_of(t, batch)
            losses[i] = loss.detach()  # (before backward, which applies the update under plan.optimizer_in_backward:
            t.micro_losses = losses  # the trainer reads the loss when it starts)
            in_backward.new_backward(t.optimizer)
            t.phase("backward")
            of = "loss()" if t.model_file.has("loss") else "the model"
            with t.model_file.user_code(f"the backward pass of {of}"):  # a recompute mismatch, a custom Function
                part = loss / n if weights is None else loss * weights[i]  # (a short batch: its examples' part)
                t.scaler.scale(part).backward()  # grads accumulate across micro-steps
        del loss
    return losses


@contextlib.contextmanager
def _sparse_gradients_refused(t: Training) -> Iterator[None]:
    """A sparse gradient that build() could not see (F.embedding(..., sparse=True), a custom Function) makes
    clipping or the optimizer fail with a kernel's error: the same one line as a sparse nn.Embedding instead."""
    try:
        yield
    except (NotImplementedError, RuntimeError) as e:
        sparse = next((n for n, p in t.module.named_parameters() if p.grad is not None and p.grad.is_sparse), None)
        if sparse is None or is_oom(e):
            raise
        raise ModelFileError(f"{t.model_file.label}: backward gave {sparse} a sparse gradient (sparse=True in "
                             "F.embedding or the like?): sparse gradients are not supported (the training step "
                             "clips their norm, and the memory levers need dense ones)") from e


def train_step(t: Training, micro_batches: Sequence[Batch], step: int = 0,
               weights: Sequence[float] | None = None) -> torch.Tensor:
    """Optimizer step `step` (0: the first; a probe's trials take each as a first) over `micro_batches` (normally
    grad_accum_steps of them; on several ranks, this rank's share of the global batch). `weights`: each
    micro-batch's part of the step's gradient, where they are not equal (a pass's short last batch: its examples
    over the step's); None: 1 / len(micro_batches) each. Returns this rank's mean loss (weighted alike) as a
    detached 0-dim tensor (reading it is a sync point; the caller decides when)."""
    n = len(micro_batches)
    fsdp = t.plan.sharding == "fsdp"  # its forward and backward hold collectives
    t.micro_losses = t.dist.agreed(lambda: _accumulate(t, micro_batches, weights), fsdp)  # every rank: OOM or not
    t.phase("optimizer")
    sync_gradients(t.model, t.plan.sharding, t.dist)  # ddp: averaged once a step; otherwise nothing
    with _sparse_gradients_refused(t):
        if t.clip_grad_norm is not None:
            t.scaler.unscale_(t.optimizer)  # clip the true gradients, not the scaled ones
            made_optim.clip(gradient_holders(t.optimizer, t.model), t.clip_grad_norm)  # (computed on real tensors)
        with made_optim.stepping(t.optimizer, t.last_of_trial):
            t.scaler.step(t.optimizer)  # skips the step when fp16 gradients overflowed
    scale = t.scaler.get_scale() if t.rank_allocator is not None and t.scaler.is_enabled() and t.device.computes \
        else None  # (on the fake device, which computes no values, every step is taken)
    t.scaler.update()  # (the scale drops exactly when the step was skipped)
    after_optimizer_step(t.rank_allocator, t.optimizer, step, scale is not None and t.scaler.get_scale() < scale)
    t.optimizer.zero_grad(set_to_none=True)  # frees gradient memory until the next backward
    losses, t.micro_losses = t.micro_losses, None
    if weights is not None:
        return (losses * torch.tensor(weights, device=losses.device)).sum() / sum(weights)
    return losses.sum() / n


def make_optimizer_state(t: Training) -> torch.Tensor | None:
    """Make the optimizer state the first step makes, without a forward and backward: every trained parameter
    gets a zero gradient (handed to an offloading optimizer as backward's hooks hand it), the optimizer steps once
    (or only makes its state, where it can: the 8-bit one, torch's Adam and AdamW), and zero_grad frees the
    gradients. On the fake device, where no value is computed, a trial that starts from it sees the steady state's
    peak in its first step: one step, not two. It assumes backward reaches every trained parameter; the caller
    checks (every_gradient_made). Returns a zero loss, as train_step returns a 0-dim loss (the caller holds it
    through the next step); None (nothing done) where that would not be the first step's state: the model file's
    own optimizer (it may need a closure, or keep no state for a zero gradient), lazy parameters not yet
    materialized, or a parameter with a post-accumulate-grad hook (an optimizer stepped in backward: the gradient
    may never reach this optimizer, and the model file's own optimizers make their state in the first backward)."""
    params = [p for p in t.module.parameters() if p.requires_grad]
    if t.model_file.has("optimizer") or t.steps_in_backward or any(nn.parameter.is_lazy(p) for p in params):
        return None
    t.phase("optimizer")
    make_state = getattr(t.optimizer, "make_state", None)
    if make_state is not None:  # its state's tensors without an update: the update's scratch is the next step's
        make_state()
    else:
        offload = getattr(t.optimizer, "take_gradient", None)
        with torch.no_grad():
            for p in params:
                p.grad = torch.zeros_like(p)
                if offload is not None:  # to the host at once, as backward's hook moves each as it is made
                    offload(p)
        if not _init_adam_state(t.optimizer):
            t.optimizer.step()
        t.optimizer.zero_grad(set_to_none=True)
    after_optimizer_step(t.rank_allocator, t.optimizer, 0, False)  # AdaLoRA: the scores the first step keeps
    if t.scaler.is_enabled():  # fp16: the scale and growth tracker the first step's scale() makes
        t.scaler.scale(torch.zeros((), device=t.device.torch_device))
    return torch.zeros((), device=t.device.torch_device)


_ADAM_INIT_ARGS = {"params_with_grad", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps", "amsgrad"}


def _init_adam_state(optimizer: torch.optim.Optimizer) -> bool:
    """torch's own Adam and AdamW (the default optimizer): the state their first step makes, by the lazy
    initialization that step runs first (`_init_group`: step counters, first and second moments), without the
    update, whose scratch the next step makes again (on the fake device the update was a third of a trial's
    dispatched ops). False, and nothing done, for any other optimizer or an initialization of another shape than
    torch 2.4-2.13's: the caller then steps."""
    init = getattr(optimizer, "_init_group", None)
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or init is None:
        return False
    names = list(inspect.signature(init).parameters)
    if not names or names[0] != "group" or not set(names[1:]) <= _ADAM_INIT_ARGS:
        return False
    for group in optimizer.param_groups:
        init(group, **{n: group["amsgrad"] if n == "amsgrad" else [] for n in names[1:]})
    return True


def every_gradient_made(t: Training) -> bool:
    """At the optimizer step: did backward give every trained parameter a gradient (under offload: to the host)?"""
    trained = sum(p.requires_grad for p in t.module.parameters())
    return sum(h.grad is not None for h in gradient_holders(t.optimizer, t.model)) >= trained


def _hooked(p: nn.Parameter) -> bool:
    return bool(getattr(p, "_post_accumulate_grad_hooks", None))


def steps_in_backward(module: nn.Module) -> int:
    """How many of the module's trained parameters have post-accumulate-grad hooks: the model file steps an
    optimizer in backward (PyTorch's and torchtune's optimizer-in-backward), or may."""
    return sum(_hooked(p) for p in module.parameters() if p.requires_grad)


def release_tensor_hooks(module: nn.Module) -> None:
    """Empty the post-accumulate-grad hooks of a model done with. Autograd holds them from C++, where the garbage
    collector does not look: a hook that reaches its own parameter (an optimizer stepped in backward, as PyTorch's
    tutorial writes it) kept the whole model alive, and every trial after it measured it too."""
    for p in module.parameters():
        hooks = getattr(p, "_post_accumulate_grad_hooks", None)
        if hooks:
            hooks.clear()


@torch.no_grad()
def eval_loss(t: Training, batches: Sequence[Batch], weights: Sequence[int] | None = None) -> torch.Tensor:
    """Mean loss over `batches` without building a graph (same autocast as training), each batch's loss weighted
    by `weights` (its examples; None: equally)."""
    t.model.eval()
    weights = weights or [1] * len(batches)

    def run() -> torch.Tensor:
        total = torch.zeros((), device=t.device.torch_device)
        for batch, weight in zip(batches, weights, strict=True):
            with autocast(t):
                total += loss_of(t, batch).float() * weight
        return total

    try:
        return t.dist.agreed(run, t.plan.sharding == "fsdp") / max(sum(weights), 1)
    finally:
        t.model.train()


def state_bytes(t: Training) -> int:
    """What this rank holds of the model's state through a step: its parameters and buffers, one gradient per
    trainable parameter (what backward makes) and the optimizer state - under FSDP, its local shards. Bytes,
    512-rounded per storage as the CUDA allocator rounds."""
    from .memory.tracker import MemoryTracker, rounded

    counter = MemoryTracker(follow=False)  # called every logged step: it must leave nothing behind
    held = counter.track(t.module, t.optimizer)  # parameters, buffers, gradients alive now, optimizer state
    for p in t.module.parameters():
        if p.requires_grad and p.grad is None:  # zero_grad(set_to_none) freed it: it comes back every backward
            local = getattr(p, "_local_tensor", p)
            held += rounded(local.numel() * local.element_size())
    return held
