"""Watching the training loss for a NaN or an infinity, without a sync point per micro-batch.

A non-finite training loss in any micro-batch stops the run before that step's optimizer update: `LossWatch`
records each micro-batch's loss (detached, on the device) and `check` reads them once a step, when the step
reaches its optimizer phase. There is no skipping of a bad batch: a NaN from one batch or from a run that diverged
stop alike. (fp16's GradScaler skipping a step whose *gradients* overflowed is not a stop: the loss was finite,
the scale drops and training goes on.)
"""

from __future__ import annotations

from typing import Any

import torch

from ..dist.group import Dist
from ..model_file import Batch


class NonFiniteLoss(Exception):
    """A training micro-batch's loss was NaN or infinite (on some rank): raised before the step's update."""

    def __init__(self, values: list[float]):
        super().__init__("non-finite training loss")
        self.values = values  # this rank's micro-batch losses of the step


class LossWatch:
    """Stands in for the model file inside the training step (`step.py` calls `t.model_file.loss`): keeps each
    training micro-batch's loss of the step in flight."""

    def __init__(self, model_file: Any):
        self.model_file = model_file
        self.losses: list[torch.Tensor] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model_file, name)

    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        value = self.model_file.loss(model, batch)
        if torch.is_grad_enabled():  # a training micro-step; evaluation runs under no_grad
            self.losses.append(value.detach())
        return value

    def forget(self) -> None:
        self.losses = []

    def check(self, dist: Dist) -> None:
        """Raise NonFiniteLoss if a loss of this step is not finite on any rank. One sync point a step (and one
        all-reduce on several ranks, so that they all stop at the same step)."""
        losses, self.losses = self.losses, []
        if not losses:
            return
        values = torch.stack([v.float() for v in losses])
        bad = not bool(torch.isfinite(values).all())
        if bool(dist.max(1.0 if bad else 0.0)[0]):
            raise NonFiniteLoss(values.tolist())


def non_finite_buffer(module: torch.nn.Module) -> str | None:
    """The first floating-point buffer (BatchNorm running statistics, say) holding a NaN or an infinity."""
    for name, buf in module.named_buffers():
        if buf.is_floating_point() and not bool(torch.isfinite(buf).all()):
            return name
    return None


def tainted_buffer(module: torch.nn.Module, dist: Dist) -> str | None:
    """A buffer (running statistics) the failed forwards already made non-finite, on any rank: all ranks save, or
    none, a checkpoint being collective."""
    tainted = non_finite_buffer(module)
    if bool(dist.max(0.0 if tainted is None else 1.0)[0]):
        return tainted or "of another rank"
    return None
