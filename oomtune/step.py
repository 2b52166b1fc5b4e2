"""The one training step. The probe's trials and the trainer both call `train_step`; nothing else may
re-implement it, so what the probe measured is what training uses.

One step = grad_accum_steps micro-steps (forward under autocast, loss / grad_accum_steps, scaled
backward through checkpointed blocks) + one optimizer step (unscale, clip, GradScaler step, zero_grad
with set_to_none=True so gradient memory is freed between steps).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .devices import Device
from .model_file import Batch, ModelFile
from .plan import Plan

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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

    def phase(self, name: str) -> None:
        if self.on_phase is not None:
            self.on_phase(name)


def build_training(model_file: ModelFile, plan: Plan, device: Device, lr: float,
                   clip_grad_norm: float | None = None, weight_decay: float | None = None) -> Training:
    """Build the model on the device, wrap its blocks for checkpointing, make the optimizer and scaler."""
    with device.placement():
        model = model_file.build()
    if any(t.device != device.torch_device for t in (*model.parameters(), *model.buffers())):
        model.to(device.torch_device)  # anything build_model placed explicitly elsewhere (never on fake tensors:
        #                                Module.to swaps them, and a FakeTensor with weak references refuses)
    model.train()
    if plan.activation_checkpointing:
        model_file.enable_checkpointing(model)
    optimizer = model_file.optimizer([p for p in model.parameters() if p.requires_grad], lr)
    if weight_decay is not None:
        for group in optimizer.param_groups:
            if "weight_decay" in group:
                group["weight_decay"] = weight_decay
    # a GradScaler only does anything for fp16: bf16 has fp32's range
    scaler = torch.amp.GradScaler(device.autocast_device_type, enabled=plan.precision == "fp16")
    return Training(model, optimizer, scaler, plan, model_file, device, clip_grad_norm)


def autocast(t: Training) -> contextlib.AbstractContextManager:
    if t.plan.precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(t.device.autocast_device_type, dtype=DTYPES[t.plan.precision])


def train_step(t: Training, micro_batches: Sequence[Batch]) -> torch.Tensor:
    """One optimizer step over `micro_batches` (normally grad_accum_steps of them).
    Returns the mean loss as a detached 0-dim tensor (reading it is a sync point; the caller decides when)."""
    n = len(micro_batches)
    total = torch.zeros((), device=t.device.torch_device)
    for batch in micro_batches:
        t.phase("forward")
        with autocast(t):
            loss = t.model_file.loss(t.model, batch)
        t.phase("backward")
        t.scaler.scale(loss / n).backward()  # grads accumulate across micro-steps
        total += loss.detach().float()
        del loss
    t.phase("optimizer")
    if t.clip_grad_norm is not None:
        t.scaler.unscale_(t.optimizer)  # clip the true gradients, not the scaled ones
        nn.utils.clip_grad_norm_(t.model.parameters(), t.clip_grad_norm)
    t.scaler.step(t.optimizer)  # skips the step when fp16 gradients overflowed
    t.scaler.update()
    t.optimizer.zero_grad(set_to_none=True)  # frees gradient memory until the next backward
    return total / n


@torch.no_grad()
def eval_loss(t: Training, batches: Sequence[Batch]) -> torch.Tensor:
    """Mean loss over `batches` without building a graph (same autocast as training)."""
    t.model.eval()
    try:
        total = torch.zeros((), device=t.device.torch_device)
        for batch in batches:
            with autocast(t):
                total += t.model_file.loss(t.model, batch).float()
        return total / max(len(batches), 1)
    finally:
        t.model.train()
