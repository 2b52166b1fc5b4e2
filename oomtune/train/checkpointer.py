"""How a run's state goes to disk and comes back: one interface over the two checkpoint formats.

`FileCheckpointer` (one process): one file `ckpt-<step>.pt` (checkpoint.py). `DcpCheckpointer` (a process group,
of one rank or several): a DCP folder `ckpt-<step>/` every rank writes its part of (dist_checkpoint.py); it also
reads a one-process file into a run on several ranks. Saving through the DCP one is collective: every rank must
call it at the same step, so a rank that fails alone cannot save (`collective`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from ..dist.group import Dist
from ..errors import BAD_INPUT, OomtuneError
from ..step import Training
from . import dist_checkpoint
from .checkpoint import KEEP, save_checkpoint, state_dict_mismatch


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
    mismatch = state_dict_mismatch(t.module.state_dict(), state["model"])
    if mismatch:
        raise OomtuneError(f"checkpoint {path} does not match {label}'s model: {mismatch}", BAD_INPUT)


class FileCheckpointer:
    """One process: the whole state in one file."""

    collective = False

    def save(self, run_dir: Path, meta: dict[str, Any], rng: dict[str, Any], t: Training, keep: int = KEEP) -> Path:
        return save_checkpoint(run_dir, {**meta, "model": t.model.state_dict(), "optimizer": t.optimizer.state_dict(),
                                         "rng": rng}, keep)

    def load(self, path: Path, state: dict[str, Any], t: Training, label: str) -> None:
        _check_model(path, state, t, label)
        t.model.load_state_dict(state["model"])
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
        return dist_checkpoint.save_state(run_dir, meta, rng, t, self.dist, keep)

    def load(self, path: Path, state: dict[str, Any], t: Training, label: str) -> None:
        if self._folder(state):
            dist_checkpoint.load_state(path, t)
            return
        _check_model(path, state, t, label)
        dist_checkpoint.load_single_file(state, t)

    def rng(self, path: Path, state: dict[str, Any], rank: int) -> dict[str, Any] | None:
        if self._folder(state):
            return dist_checkpoint.load_rng(path, rank)
        return state["rng"] if rank == 0 else None  # a one-process file has rank 0's only

    @staticmethod
    def _folder(state: dict[str, Any]) -> bool:
        return state.get("layout") == dist_checkpoint.LAYOUT


def checkpointer_for(dist: Dist) -> Checkpointer:
    return DcpCheckpointer(dist) if dist.grouped else FileCheckpointer()
