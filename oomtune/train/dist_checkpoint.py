"""Checkpoints of a run on several ranks: torch.distributed.checkpoint (DCP), resumable on any number of ranks.

A checkpoint is a folder `ckpt-<step>/`: the model and optimizer state saved by every rank with DCP (FSDP's
shards as shards; DDP's replicas once), each rank's RNG state (`rng-<rank>.pt`), and `oomtune.pt` (step, plan,
data position, GradScaler, written by rank 0 last). The ranks write into `.ckpt-<step>.tmp/` and rank 0 renames
it once all have finished, so a kill at any moment leaves the previous checkpoints whole. Loading reads the
state into the model as it is built now - FSDP or DDP or one process, on as many ranks as this run has - and
DCP reshards (the state dicts are keyed by parameter name, `get_state_dict` / `set_state_dict`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ..dist.group import Dist
from ..errors import first_line
from ..step import Training
from .checkpoint import (
    FORMAT,
    KEEP,
    LAYOUT,
    META,
    VERSION,
    CheckpointError,
    fsync_dir,
    prune,
    remove,
    unreadable_because,
)
from .checkpoint_fields import rng_problem


def folder(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"ckpt-{step:08d}"


def save_state(run_dir: Path, meta: dict[str, Any], rng: dict[str, Any], t: Training, d: Dist,
               keep: int = KEEP) -> Path:
    """Every rank calls this at the same step. Returns the checkpoint folder."""
    run_dir = Path(run_dir)
    final = folder(run_dir, int(meta["step"]))
    tmp = run_dir / f".{final.name}.tmp"
    if d.is_main:
        remove(tmp)
        tmp.mkdir(parents=True)
    d.barrier()
    model_state, optim_state = get_state_dict(t.model, t.optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp))
    with open(tmp / f"rng-{d.rank}.pt", "wb") as f:  # on disk before the folder is published (DCP's own
        torch.save(rng, f)                               # writer fsyncs its files: sync_files defaults to True)
        f.flush()
        os.fsync(f.fileno())
    d.barrier()
    if d.is_main:
        with open(tmp / META, "wb") as f:
            torch.save({"format": FORMAT, "version": VERSION, "layout": LAYOUT, "world_size": d.world_size, **meta},
                       f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        remove(final)  # the same step saved again (an OOM stop right after an interval checkpoint)
        os.replace(tmp, final)
        fsync_dir(run_dir)
        prune(run_dir, keep)
    d.barrier()
    return final


def load_state(path: Path, t: Training) -> None:
    """Load a checkpoint folder's model and optimizer state into `t` (resharded for this run's ranks)."""
    model_state, optim_state = get_state_dict(t.model, t.optimizer)  # the layout of this run; creates optimizer state
    state = {"model": model_state, "optimizer": optim_state}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as e:  # a missing key, a shape that does not match, a torn file
        raise CheckpointError(f"checkpoint {path} does not match this model or optimizer: {first_line(e)}") from None
    set_state_dict(t.model, t.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def load_rng(path: Path, rank: int) -> dict[str, Any] | None:
    """This rank's RNG state in the checkpoint (None when the checkpoint had fewer ranks)."""
    p = Path(path) / f"rng-{rank}.pt"
    if not p.is_file():
        return None
    try:
        rng = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {p} {unreadable_because(p, e)}") from None
    wrong = rng_problem(rng)
    if wrong is not None:
        raise CheckpointError(f"checkpoint {p} is not one oomtune wrote: {wrong}")
    return rng


def load_single_file(state: dict[str, Any], t: Training) -> None:
    """A single-process checkpoint (ckpt-N.pt) into a run on several ranks: every rank reads the whole file and
    keeps its part (`full_state_dict`); the optimizer state, saved by parameter index, is re-keyed by name."""
    module = t.module
    names = {id(p): n for n, p in module.named_parameters()}
    params = [p for g in t.optimizer.param_groups for p in g["params"]]
    saved = state["optimizer"]
    index_to_name = {i: names[id(p)] for i, p in enumerate(params)}
    optim = {"state": {index_to_name[int(i)]: s for i, s in saved["state"].items()},
             "param_groups": [{**g, "params": [index_to_name[int(i)] for i in g["params"]]}
                              for g in saved["param_groups"]]}
    set_state_dict(t.model, t.optimizer, model_state_dict=state["model"], optim_state_dict=optim,
                   options=StateDictOptions(full_state_dict=True))
