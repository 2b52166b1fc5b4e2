"""Watching the training loss for a NaN or an infinity, without a sync point per micro-batch.

A non-finite training loss in any micro-batch stops the run before that step's optimizer update: the step keeps
each micro-batch's loss (detached, on the device, in one tensor: `Training.micro_losses`) and `check_losses` reads
them once a step, when the step reaches its optimizer phase. There is no skipping of a bad batch: a NaN from one
batch or from a run that diverged stop alike. (fp16's GradScaler skipping a step whose *gradients* overflowed is
not a stop: the loss was finite, the scale drops and training goes on.)
"""

from __future__ import annotations

import torch

from ..dist.group import Dist


class NonFiniteLoss(Exception):
    """A training micro-batch's loss was NaN or infinite (on some rank): raised before the step's update."""

    def __init__(self, values: list[float]):
        super().__init__("non-finite training loss")
        self.values = values  # this rank's micro-batch losses of the step


def check_losses(losses: torch.Tensor | None, dist: Dist) -> None:
    """Raise NonFiniteLoss if a micro-batch loss of this step (`losses`; None: none yet) is not finite on any rank.
    One sync point a step (and one all-reduce on several ranks, so that they all stop at the same step)."""
    if losses is None:
        return
    bad = not bool(torch.isfinite(losses).all())
    if bool(dist.max(1.0 if bad else 0.0)[0]):
        raise NonFiniteLoss(losses.tolist())


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
