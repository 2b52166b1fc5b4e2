"""PEFT's AdaLoRA reallocates its adapters' ranks as it trains: after each optimizer step, before the gradients
are dropped, `update_and_allocate(step)` scores every adapter weight from its gradient (three fp32 copies of each
kept between steps) and, on its schedule (tinit, deltaT, tfinal of total_step), masks the least important ranks.

The training step calls it (`after_optimizer_step`), so a probe's trial measures the scores it keeps and a run
trains the adapter AdaLoRA's config describes, not a fixed-rank one; a checkpoint carries the scores and the rank
pattern (`saved`, `restore`), so a resumed run allocates as the uninterrupted one would have."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

SCORES = ("ipt", "exp_avg_ipt", "exp_avg_unc")  # the allocator's per-weight tensors (sensitivity and its EMAs)
KEY = "rank_allocation"  # a checkpoint's key for the allocator's state


def allocator_of(model: nn.Module) -> nn.Module | None:
    """The module whose `update_and_allocate` reallocates ranks (PEFT's AdaLoraModel), or None."""
    for m in model.modules():  # its own attributes (a PeftModel forwards both to the AdaLoraModel inside it)
        if callable(getattr(type(m), "update_and_allocate", None)) and "rankallocator" in vars(m):
            return m
    return None


def reset(model: nn.Module) -> None:
    """Drop the scores of earlier steps (a probe's trial that reuses the model starts as a fresh build)."""
    owner = allocator_of(model)
    if owner is not None:
        owner.rankallocator.reset_ipt()


@contextlib.contextmanager
def _gradients_at_hand(owner: nn.Module, optimizer) -> Iterator[None]:
    """Inside, every trained weight of `owner` has its step's gradient on its device as `.grad`, the way the
    allocator reads it: under the offload lever the gradients are on the host (brought back for the call and
    dropped after); a weight backward did not reach has a zero one (no sensitivity) for the call."""
    params = [p for p in owner.parameters() if p.requires_grad]
    back = getattr(optimizer, "gradient_of", None)
    made = []
    for p in params:
        if p.grad is None:
            g = back(p) if back is not None else None
            p.grad = torch.zeros_like(p) if g is None else g.to(p.device, copy=True)
            made.append(p)
    try:
        yield
    finally:
        for p in made:
            p.grad = None


def after_optimizer_step(owner: nn.Module | None, optimizer, step: int, skipped: bool) -> None:
    """Score and reallocate after optimizer step `step` (0 for the first), as PEFT's training loops do; not after a
    step the GradScaler skipped (fp16 overflow: its gradients hold inf, which would stay in the scores)."""
    if owner is None or skipped:
        return
    with _gradients_at_hand(owner, optimizer):
        owner.update_and_allocate(step)


def _config(owner: nn.Module):
    return owner.peft_config[owner.trainable_adapter_name]


def saved(owner: nn.Module | None) -> dict:
    """{KEY: the allocator's scores (on the host) and rank pattern} for a checkpoint; {} without an allocator
    (`owner`: allocator_of's, which Training keeps as rank_allocator)."""
    if owner is None:
        return {}
    ra = owner.rankallocator
    state = {name: {n: t.detach().to("cpu", copy=True) for n, t in getattr(ra, name).items()} for name in SCORES}
    return {KEY: {**state, "rank_pattern": _config(owner).rank_pattern}}


def restore(owner: nn.Module | None, state: dict | None) -> None:
    """Put a checkpoint's allocator state (`saved`'s value) back into `owner`; a checkpoint without one (written
    before the allocator was called, or of another model) leaves the allocator as built."""
    if owner is None or not state:
        return
    weights = dict(owner.model.named_parameters())  # the names the allocator keys by
    ra = owner.rankallocator
    for name in SCORES:
        setattr(ra, name, {n: t.to(weights[n].device) for n, t in state[name].items()})
    if state.get("rank_pattern") is not None:
        _config(owner).rank_pattern = state["rank_pattern"]


def notes(owner: nn.Module | None, steps: int) -> list[str]:
    """What a run of `steps` optimizer steps should know of `owner`'s AdaLoRA schedule: its total_step differs (the
    budget shrinks until total_step - tfinal, whatever the run's length)."""
    c = _config(owner) if owner is not None else None
    if c is None or c.total_step == steps:
        return []
    end = "the run ends before the ranks reach target_r" if steps < c.total_step - c.tfinal else \
        "the schedule does not match the run"
    return [f"AdaLoRA's total_step is {c.total_step}, and this run trains {steps} steps: {end} (set total_step to "
            "the run's --steps)"]
