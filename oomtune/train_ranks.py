"""The trainer's state on one rank or several: each rank's share of the data, checkpoints (a single file, or a
DCP folder on several ranks) and the metrics reduced over the ranks.

Data on several ranks: every rank draws the same global stream (same seed) and keeps its share of each global
batch - rank r the r-th of world_size equal slices. What a step trains on therefore does not depend on the
number of ranks, and a checkpoint of N ranks resumed on M replays the same stream to the same position.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import dist_checkpoint
from .checkpoint import (
    KEEP,
    CheckpointError,
    capture_rng,
    load_checkpoint,
    older_intact,
    restore_rng,
    save_checkpoint,
    state_dict_mismatch,
)
from .data import split_batch
from .devices import is_oom
from .errors import BAD_INPUT, ConfigError, OomtuneError, first_line
from .model_file import Batch
from .plan import Plan, to_dict
from .step import as_on_cuda, set_weight_decay
from .train_events import Checkpointed, Note


def plan_for_ranks(plan: Plan, world_size: int, where: str) -> Plan:
    """`plan` (from the config or a checkpoint) on this run's number of ranks, same global batch."""
    if plan.world_size == world_size and (world_size == 1 or plan.sharding != "none"):
        return plan
    scaled = plan.for_world_size(world_size)
    if scaled is None:
        raise OomtuneError(f"{where}: global batch {plan.global_batch_size} cannot be shared out evenly over "
                           f"{world_size} ranks; change --nproc-per-node", BAD_INPUT)
    return scaled


def share_size(plan: Plan, data_batch: int, where: str) -> int:
    """Examples per piece of this rank's share: whole drawn batches, or equal cuts of one."""
    per_rank = plan.global_batch_size // plan.world_size
    piece = min(data_batch, per_rank)
    if (per_rank % data_batch if data_batch <= per_rank else data_batch % per_rank) or piece % plan.micro_batch_size:
        raise OomtuneError(f"{where}: batches of {data_batch} cannot be shared out as {per_rank} examples per rank "
                           f"in micro-batches of {plan.micro_batch_size}", BAD_INPUT)
    return piece


def load_latest(latest: Path) -> tuple[dict, Plan]:
    """The latest checkpoint and its plan. A broken one is never touched: the error names an older one that is
    intact, and how to resume from it."""
    try:
        state = load_checkpoint(latest)
        return state, checkpoint_plan(latest, state)
    except CheckpointError as e:
        older = older_intact(latest)
        if older is None:
            raise
        raise CheckpointError(f"{e.message}. An older checkpoint is intact, {older.name}: move {latest.name} out "
                              f"of {latest.parent} and rerun with --resume to continue from it") from None


def checkpoint_plan(path: Path, st: dict) -> Plan:
    """The plan a checkpoint was written with, checked against its data position."""
    try:
        plan = Plan(**st["plan"])
        batch = int(st["data"]["batch_size"])
        step = int(st["step"])
    except (TypeError, KeyError, ValueError, ConfigError) as e:
        raise CheckpointError(f"checkpoint {path} has an unreadable plan or data position ({first_line(e)})") \
            from None
    if batch % plan.micro_batch_size or plan.global_batch_size % batch or step < 0:
        raise CheckpointError(f"checkpoint {path}: data batch {batch} does not fit plan {plan.describe()}")
    return plan


class RanksMixin:
    """Expects the Trainer's state: plan, data_batch, piece, dist, rank, t, device, cuda, step, cfg, model_file,
    data_hook, run_dir, log, notes, resumed_from, file_config, and `_emit` / `_account`."""

    @property
    def batches_per_step(self) -> int:
        """Batches of the global stream per optimizer step (all ranks together)."""
        return self.plan.global_batch_size // self.data_batch

    def _label(self) -> str:
        return f"{self.model_file.label}: {self.data_hook}()"

    def _share(self, batches: list[Batch]) -> list[Batch]:
        """This rank's pieces of the global batches (each `self.piece` examples)."""
        if self.dist is None or self.dist.world_size == 1:
            return batches
        ws, r = self.dist.world_size, self.dist.rank
        if self.piece == self.data_batch:
            k = len(batches) // ws
            return batches[r * k:(r + 1) * k]
        parts = self.data_batch // self.piece
        pieces = [p for b in batches for p in split_batch(b, self.data_batch, parts, self._label())]
        k = len(pieces) // ws
        return pieces[r * k:(r + 1) * k]

    def _micro_batches(self, pieces: list[Batch], size: int | None = None) -> list[Batch]:
        size = size or self.piece
        parts = size // self.plan.micro_batch_size
        return [m for b in pieces for m in split_batch(b, size, parts, self._label())]

    def _eval_share(self, batches: list[Batch]) -> list[Batch]:
        """Evaluation micro-batches of this rank: an equal share when they divide evenly, else all of them."""
        micro = self._micro_batches(batches, self.data_batch)
        if self.dist is None or self.dist.world_size == 1 or len(micro) % self.dist.world_size:
            return micro
        k = len(micro) // self.dist.world_size
        return micro[self.dist.rank * k:(self.dist.rank + 1) * k]

    # -- numbers over the ranks --------------------------------------------------------------------
    def _mean_over_ranks(self, value: float) -> float:
        return value if self.dist is None else self.dist.sum(value)[0] / self.dist.world_size

    def _max_over_ranks(self, value: int) -> int:
        return value if self.dist is None else int(self.dist.max(value)[0])

    def _stop_over_ranks(self, signal_name: str | None) -> str | None:
        """A signal reaches the ranks at different moments: all stop after the same step."""
        if self.dist is None or self.dist.world_size == 1:
            return signal_name
        return (signal_name or "SIGTERM") if self.dist.max(1 if signal_name else 0)[0] else None

    # -- checkpoints -------------------------------------------------------------------------------
    def _checkpoint(self, reason: str, keep: int = KEEP) -> Path:
        """Save the state of the last finished step (`self.step`); keep the newest `keep` checkpoints."""
        self.phase = "checkpoint"  # an error while writing: no second try (fallback.FailureMixin)
        t = self.t
        meta = {
            "step": self.step, "plan": to_dict(self.plan),
            "data": {"batch_size": self.data_batch, "batches": self.step * self.batches_per_step,
                     "hook": self.data_hook},
            "scaler": t.scaler.state_dict(), "train": to_dict(self.cfg), "model_file": str(self.model_file.path),
            "torch_version": str(torch.__version__),
        }
        if self.dist is not None:  # every rank writes its part
            path = dist_checkpoint.save_state(self.run_dir, meta, capture_rng(self.cuda), t, self.dist, keep)
        else:
            path = save_checkpoint(self.run_dir, {**meta, "model": t.model.state_dict(),
                                                  "optimizer": t.optimizer.state_dict(),
                                                  "rng": capture_rng(self.cuda)}, keep)
        self.last_checkpoint, self.checkpoint_step = path, self.step
        self.log.event("checkpoint", step=self.step, path=path.name, reason=reason)
        self._emit(Checkpointed(self.step, path, reason))
        self.phase = "after"
        return path

    def _restore(self, st: dict) -> None:
        t, path = self.t, self.resumed_from
        folder = st.get("layout") == dist_checkpoint.LAYOUT
        if not folder:  # name the first key that differs, not torch's "Error(s) in loading state_dict for Net:"
            mismatch = state_dict_mismatch(t.module.state_dict(), st["model"])
            if mismatch:
                raise OomtuneError(f"checkpoint {path} does not match {self.model_file.label}'s model: {mismatch}",
                                   BAD_INPUT)
        try:
            with self.device.measure():
                if folder:
                    dist_checkpoint.load_state(path, t)
                elif self.dist is not None:
                    dist_checkpoint.load_single_file(st, t)
                else:
                    t.model.load_state_dict(st["model"])
                    t.optimizer.load_state_dict(st["optimizer"])
                t.scaler.load_state_dict(st["scaler"])
        except (RuntimeError, KeyError, ValueError, TypeError) as e:
            if is_oom(e):
                raise
            raise OomtuneError(f"checkpoint {path} does not match {self.model_file.label}'s model or optimizer: "
                               f"{first_line(e)}", BAD_INPUT) from None
        self._account(t.optimizer)  # the loaded state was made outside measure()
        set_weight_decay(t, self.cfg.weight_decay)  # the loaded groups bring the old run's (a flag may change it)
        as_on_cuda(t.optimizer, self.device)  # and their foreach choice
        rng = dist_checkpoint.load_rng(path, self.rank) if folder else (st["rng"] if self.rank == 0 else None)
        if rng is not None:
            restore_rng(rng, self.cuda)
        elif self.rank == 0:
            self.notes.append(Note("the checkpoint has no RNG state for some ranks (it had fewer): they keep their "
                                   "own seed, so dropout will not repeat the original run's"))
        if st["data"].get("hook") not in (None, self.data_hook):
            self.notes.append(Note(f"the checkpoint was trained on {st['data']['hook']}() data, this run uses "
                                   f"{self.data_hook}()", warning=True))
        saved = Plan(**st["plan"])
        if saved.world_size != self.plan.world_size:
            self.notes.append(Note(f"the checkpoint was written by {saved.world_size} rank(s) ({saved.sharding}), "
                                   f"resuming on {self.plan.world_size} ({self.plan.sharding}): "
                                   f"{self.plan.describe()}"))
        elif self.plan != self.file_config.plan:
            self.notes.append(Note(f"resuming with the checkpoint's plan: {self.plan.describe()} (the config "
                                   f"says {self.file_config.plan.describe()})"))
