"""The learning-rate schedule of `oomtune train`."""

from __future__ import annotations

import math

from ..config.schema import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup to cfg.lr over warmup_steps, then
    cosine decay to min_lr at cfg.steps (nanoGPT's schedule)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
