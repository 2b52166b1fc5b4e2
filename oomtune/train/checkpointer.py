"""How a run's state goes to disk and comes back: one interface over the two checkpoint formats.

`FileCheckpointer` (one process): one file `ckpt-<step>.pt` (checkpoint.py). `DcpCheckpointer` (a process group,
of one rank or several): a DCP folder `ckpt-<step>/` every rank writes its part of (dist_checkpoint.py); it also
reads a one-process file into a run on several ranks. Saving through the DCP one is collective: every rank must
call it at the same step, so a rank that fails alone cannot save (`collective`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Protocol

import torch

from .. import rank_allocation
from ..config.schema import Plan, TrainConfig
from ..dist.group import Dist
from ..errors import BAD_INPUT, OomtuneError, first_line
from ..levers import load_model_state, model_state
from ..memory.devices import Device, is_oom
from ..step import Training, as_on_cuda, set_weight_decay
from .checkpoint import KEEP, LAYOUT, save_checkpoint, state_dict_mismatch
from .events import Note
from .schedule import lr_at


class Checkpointer(Protocol):
    collective: bool  # every rank takes part in a save: one rank alone cannot write one

    def save(self, run_dir: Path, meta: dict[str, Any], rng: dict[str, Any], t: Training, keep: int = KEEP) -> Path:
        """Write the state of `t` with `meta` (step, plan, data position, ...); keep the newest `keep`."""

    def load(self, path: Path, state: dict[str, Any], t: Training, label: str) -> None:
        """Load the model and optimizer state of the checkpoint at `path` (`state`: what load_checkpoint read)
        into `t`, built for this run. A checkpoint of another model is BAD_INPUT naming its first differing key."""

    def rng(self, path: Path, state: dict[str, Any], rank: int) -> dict[str, Any] | None:
        """This rank's RNG states in the checkpoint; None when it has none for this rank (it had fewer)."""


def _check_model(path: Path, state: dict[str, Any], t: Training, label: str) -> None:
    """Name the first key that differs, not torch's "Error(s) in loading state_dict for Net:"."""
    mismatch = state_dict_mismatch(model_state(t.module), state["model"])
    if mismatch:
        raise OomtuneError(f"checkpoint {path} does not match {label}'s model: {mismatch}", BAD_INPUT)


class FileCheckpointer:
    """One process: the whole state in one file."""

    collective = False

    def save(self, run_dir: Path, meta: dict[str, Any], rng: dict[str, Any], t: Training, keep: int = KEEP) -> Path:
        return save_checkpoint(run_dir, {**meta, "model": model_state(t.model), "optimizer": t.optimizer.state_dict(),
                                         "rng": rng}, keep)

    def load(self, path: Path, state: dict[str, Any], t: Training, label: str) -> None:
        _check_model(path, state, t, label)
        load_model_state(t.model, state["model"])
        t.optimizer.load_state_dict(state["optimizer"])

    def rng(self, path: Path, state: dict[str, Any], rank: int) -> dict[str, Any] | None:
        return state["rng"]


class DcpCheckpointer:
    """A process group: a DCP folder, resharded on load for this run's ranks (or a one-process file, read whole by
    every rank)."""

    collective = True

    def __init__(self, dist: Dist):
        self.dist = dist

    def save(self, run_dir: Path, meta: dict[str, Any], rng: dict[str, Any], t: Training, keep: int = KEEP) -> Path:
        from . import dist_checkpoint

        return dist_checkpoint.save_state(run_dir, meta, rng, t, self.dist, keep)

    def load(self, path: Path, state: dict[str, Any], t: Training, label: str) -> None:
        from . import dist_checkpoint

        if self._folder(state):
            dist_checkpoint.load_state(path, t)
            return
        _check_model(path, state, t, label)
        dist_checkpoint.load_single_file(state, t)

    def rng(self, path: Path, state: dict[str, Any], rank: int) -> dict[str, Any] | None:
        from . import dist_checkpoint

        if self._folder(state):
            return dist_checkpoint.load_rng(path, rank)
        return state["rng"] if rank == 0 else None  # a one-process file has rank 0's only

    @staticmethod
    def _folder(state: dict[str, Any]) -> bool:
        return state.get("layout") == LAYOUT


def checkpointer_for(dist: Dist) -> Checkpointer:
    return DcpCheckpointer(dist) if dist.grouped else FileCheckpointer()


def restore(checkpointer: Checkpointer, path: Path, state: dict[str, Any], t: Training, device: Device,
            weight_decay: float, label: str) -> None:
    """Load a checkpoint's model, optimizer and GradScaler state into `t` on `device` (counted there), then set what
    the loaded param groups bring from the old run: the weight decay of this run, and the foreach choice."""
    other = optimizer_mismatch(state, t.optimizer)
    if other is not None:  # torch would load it and fail in the first optimizer step (a KeyError), or run it wrong
        raise OomtuneError(f"checkpoint {path} holds the state of another optimizer than {label}'s: {other}; "
                           "resume with the optimizer the run started with, or pass another --run-dir", BAD_INPUT)
    try:
        with device.measure():
            checkpointer.load(path, state, t, label)
            t.scaler.load_state_dict(state["scaler"])
            rank_allocation.restore(t.rank_allocator, state.get(rank_allocation.KEY))  # AdaLoRA's scores, where saved
    except (RuntimeError, KeyError, ValueError, TypeError) as e:
        if is_oom(e):
            raise
        raise OomtuneError(f"checkpoint {path} does not match {label}'s model or optimizer: {first_line(e)}",
                           BAD_INPUT) from None
    device.account(t.optimizer)  # the loaded state was made outside measure()
    set_weight_decay(t, weight_decay)  # the loaded groups bring the old run's (a flag may change it)
    as_on_cuda(t.optimizer, device.kind)  # and their foreach choice


def optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's class as a checkpoint records it: an offloaded one names the optimizer it runs on the host,
    `HostOffloadOptimizer(BlockwiseAdamW8bit)`, whose state is what the checkpoint holds."""
    inner = getattr(optimizer, "inner", None)
    name = type(optimizer).__name__
    return f"{name}({type(inner).__name__})" if isinstance(inner, torch.optim.Optimizer) else name


def optimizer_mismatch(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> str | None:
    """How the checkpoint's optimizer differs from `optimizer` (the model file's `optimizer()` changed since the run
    started), else None. `load_state_dict` copies the old groups and state over without a word, so AdamW's state in
    an SGD fails in its first step (KeyError: 'momentum') and Adam's in an AdamW silently drops decoupled decay."""
    saved_class = state.get("optimizer_class")
    mine = optimizer_class(optimizer)
    if isinstance(saved_class, str) and saved_class not in (mine, type(optimizer).__name__):  # (older: outer only)
        return f"it was written by {saved_class}, this run builds {mine}"
    saved = state.get("optimizer")
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list):
        return None  # a checkpoint folder (several ranks): its optimizer state is read elsewhere
    for i, (old, new) in enumerate(zip(groups, optimizer.param_groups, strict=False)):  # a count apart: torch says
        if not isinstance(old, dict):
            return None
        extra, missing = sorted(set(old) - set(new)), sorted(set(new) - set(old))
        if extra and missing:  # a newer torch only adds a setting (kept as its default): both ways is another class
            return (f"its param group {i} has {', '.join(extra)} and lacks {', '.join(missing)}, which "
                    f"{mine} uses")
    return None


def resume_notes(state: dict[str, Any], plan: Plan, in_file: Plan, data_hook: str,
                 cfg: TrainConfig | None = None) -> list[Note]:
    """What a resume says once training has started: other data than the checkpoint's, another number of ranks,
    the checkpoint's plan where the config says another, a learning rate that jumps (`cfg`: this run's settings;
    another --steps stretches or shrinks the cosine schedule)."""
    notes = []
    train = state.get("train")
    before = train.get("steps") if isinstance(train, dict) else None
    if cfg is not None and isinstance(before, int) and before != cfg.steps:
        step, was = state["step"], dataclasses.replace(cfg, steps=before)
        if not math.isclose(lr_at(step, was), lr_at(step, cfg), rel_tol=1e-6):
            notes.append(Note(f"the learning-rate schedule now decays to step {cfg.steps} (the run began with "
                              f"{before}): at step {step + 1} the learning rate goes from {lr_at(step, was):.3g} to "
                              f"{lr_at(step, cfg):.3g}", warning=True))
    if state["data"].get("hook") not in (None, data_hook):
        notes.append(Note(f"the checkpoint was trained on {state['data']['hook']}() data, this run uses "
                          f"{data_hook}()", warning=True))
    saved = Plan(**state["plan"])
    if saved.world_size != plan.world_size:
        notes.append(Note(f"the checkpoint was written by {saved.world_size} rank(s) ({saved.sharding}), resuming on "
                          f"{plan.world_size} ({plan.sharding}): {plan.describe()}"))
    elif plan != in_file:
        notes.append(Note(f"resuming with the checkpoint's plan: {plan.describe()} (the config says "
                          f"{in_file.describe()})"))
    return notes
