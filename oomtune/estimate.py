"""What the peak is made of. For now: the static part (weights, gradients, optimizer state), measured
on fake tensors so it costs no memory and works for a model far bigger than the machine."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .memtrack import MemoryTracker
from .model_file import ModelFile
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
