"""Checkpoints of a training run: written atomically, read back safely, always resumable exactly.

A single-process checkpoint is one file `ckpt-<step>.pt` in the run directory holding the model, optimizer and
GradScaler state, the step, the plan, every RNG the run draws from, and the data position (how many
batches the data stream has handed out, at what batch size). It is written to a temp file in the same
folder, fsynced, then renamed over the final name, so a reader (or a resume after SIGKILL) sees the old
set of checkpoints or the new one, never half a file. It is read with `torch.load(weights_only=True)`:
tensors, numbers, strings and containers only, no arbitrary pickled objects. A run on several ranks writes a
folder `ckpt-<step>/` instead (torch.distributed.checkpoint, see dist_checkpoint.py); both kinds are listed here.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from ..errors import BAD_INPUT, NO_FIT, OomtuneError, first_line
from ..files import NotAFileError, atomic_write, refuse_unless_file
from ..units import format_bytes
from .checkpoint_fields import field_problem

FORMAT = "oomtune-checkpoint"


VERSION = 1


KEEP = 2  # checkpoints kept on disk: the newest, and one before it in case the newest is lost


_NAME = re.compile(r"^ckpt-(\d+)(\.pt)?$")  # a file ckpt-N.pt, or a folder ckpt-N/ (several ranks)


_TEMP_FOLDER = re.compile(r"^\.ckpt-\d+\.tmp$")  # dist_checkpoint's folder being written


LAYOUT = "dcp"  # a checkpoint folder's layout (dist_checkpoint.py: torch.distributed.checkpoint, imported only there)
META = "oomtune.pt"  # in a checkpoint folder: step, plan, data position; written last, so its presence = complete


REQUIRED = ("step", "plan", "data", "model", "optimizer", "scaler", "rng")


class CheckpointError(OomtuneError):
    """A checkpoint is missing, unreadable, or does not belong to this run."""

    def __init__(self, message: str):
        super().__init__(message, BAD_INPUT)


class CheckpointWriteError(OomtuneError):
    """A checkpoint could not be written (a full disk, a folder gone read-only): exit 1, the earlier ones intact."""

    def __init__(self, message: str):
        super().__init__(message, NO_FIT)  # exit 1, as every failure of a run that had started


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / f"ckpt-{step:08d}.pt"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every finished checkpoint in run_dir, oldest first: ckpt-N.pt files and complete ckpt-N/
    folders. Temp files and folders are not checkpoints."""
    d = Path(run_dir)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _NAME.match(p.name)
        if m and not p.is_symlink() and (p.is_file() if m.group(2) else (p / META).is_file()):
            found.append((int(m.group(1)), p))  # (a link named like one is no checkpoint oomtune wrote)
    return sorted(found)


def planted(run_dir: str | Path) -> Path | None:
    """The first symbolic link in `run_dir` under a name checkpoints use (ckpt-*, .ckpt-*): oomtune never makes
    one, so one there was put there, and a write or a prune would go through it."""
    d = Path(run_dir)
    if not d.is_dir():
        return None
    return next((p for p in sorted(d.iterdir()) if p.name.startswith(("ckpt-", ".ckpt-")) and p.is_symlink()), None)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def stale_temp_files(run_dir: str | Path) -> list[Path]:
    """Temp files (`.ckpt-*.pt.*.tmp`) and folders (`.ckpt-*.tmp`) a killed checkpoint write left behind."""
    d = Path(run_dir)
    if not d.is_dir():
        return []
    found = {*d.glob(".ckpt-*.pt.*.tmp"), *(p for p in d.glob(".ckpt-*.tmp") if _TEMP_FOLDER.match(p.name))}
    return sorted(p for p in found if not p.is_symlink())


def remove(path: Path) -> None:
    """Delete a checkpoint (or temp) file or folder oomtune wrote; a symbolic link there is NotAFileError (never
    followed, never removed)."""
    if path.is_symlink():
        refuse_unless_file(path)
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def save_checkpoint(run_dir: str | Path, state: dict[str, Any], keep: int = KEEP) -> Path:
    """Write `state` as ckpt-<state['step']>.pt atomically (temp file, fsync, rename, fsync the folder), then
    delete all but the newest `keep` checkpoints. Returns the new checkpoint's path."""
    d = Path(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(d, int(state["step"]))
    try:
        atomic_write(final, lambda f: torch.save({"format": FORMAT, "version": VERSION, **state}, f))
    except NotAFileError:  # a link (or a pipe, a folder) planted under the checkpoint's name: bad input, exit 2
        raise
    except Exception as e:  # the temp file is gone; the earlier checkpoints are untouched
        raise CheckpointWriteError(write_failure(final, e)) from e
    fsync_dir(d)  # the rename itself survives a power cut
    prune(d, keep)
    return final


def write_failure(final: Path, e: BaseException) -> str:
    """One line for a checkpoint that could not be written: where, why in plain words, and what is left."""
    if isinstance(e, OSError) and e.errno is not None:
        why = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or first_line(e)).lower()
    else:  # torch's writer turns a failed write into "[enforce fail at inline_container.cc] . unexpected pos ..."
        why = f"the write failed ({first_line(e)})"
    try:
        why += f"; {format_bytes(shutil.disk_usage(final.parent).free)} free there"
    except OSError:
        pass
    kept = [p.name for _, p in list_checkpoints(final.parent) if p != final]
    left = f"the earlier checkpoints are intact: {', '.join(kept)}" if kept else "there is no earlier checkpoint"
    return f"could not write checkpoint {final}: {why}; {left}"


def prune(run_dir: Path, keep: int = KEEP) -> None:
    for _, old in list_checkpoints(run_dir)[:-keep]:
        remove(old)


def fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # some filesystems / platforms cannot open a folder
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint safely (weights_only: no code runs) onto the CPU; any problem is one CheckpointError
    line naming the file. For a folder (several ranks) this reads its metadata; the weights and optimizer state
    are loaded into the built model by dist_checkpoint.load_state."""
    p = Path(path)
    if p.is_dir():
        return _validate(p, _read(p / META), required=("step", "plan", "data", "scaler", "layout"))
    return _validate(p, _read(p), required=REQUIRED)


def _read(p: Path) -> Any:
    try:
        with warnings.catch_warnings():  # (torch's note on a pickle protocol it did not write: the error says more)
            warnings.simplefilter("ignore", UserWarning)
            state = torch.load(p, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint not found: {p}") from None
    except Exception as e:  # truncated zip, bit rot, a file that is not a checkpoint, a pickled object
        raise CheckpointError(f"checkpoint {p} {unreadable_because(p, e)}") from None
    damaged = _zip_damage(p)  # torch.load reads the parts without checking their CRCs: flipped bytes load silently
    if damaged is not None:
        raise CheckpointError(f"checkpoint {p} {damaged}")
    return state


def _zip_damage(p: Path) -> str | None:
    """Why the zip archive torch.save wrote is damaged (a part whose bytes fail its CRC, or no index), else None."""
    try:
        with zipfile.ZipFile(p) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return f"is truncated or damaged: {p.stat().st_size:,} bytes without a complete zip index (a copy cut short?)"
    return f"is damaged: its part {bad} fails its checksum" if bad is not None else None


def unreadable_because(p: Path, e: BaseException) -> str:
    """Why torch.load failed, in plain words. torch says little ("[Errno 22] Invalid argument" for a truncated
    file, "101" for one that is not a checkpoint); the file's zip structure (torch.save writes a zip) says more."""
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(4)
    except OSError as err:
        return f"cannot be read ({err.strerror or first_line(err)})"
    if size == 0:
        return "is empty (0 bytes)"
    if head != b"PK\x03\x04":
        return f"is not a checkpoint: {size:,} bytes that are not a PyTorch file (torch.save writes a zip archive)"
    damaged = _zip_damage(p)
    if damaged is not None:
        return damaged
    if isinstance(e, pickle.UnpicklingError):  # weights_only refused an object
        return f"holds something other than tensors and plain values ({first_line(e)})"
    return f"cannot be read ({type(e).__name__}: {first_line(e)})"


def older_intact(latest: Path) -> Path | None:
    """The newest checkpoint older than `latest` in its folder that loads, else None."""
    for _, p in reversed(list_checkpoints(latest.parent)):
        if p == latest:
            continue
        try:
            load_checkpoint(p)
        except CheckpointError:
            continue
        return p
    return None


def state_dict_mismatch(expected: dict[str, Any], saved: Any) -> str | None:
    """How a saved model state dict differs from the model's: the first key of each kind and the counts."""
    if not isinstance(saved, dict):
        return f"its model state is {type(saved).__name__}, not a state dict"
    parts = []
    missing = [k for k in expected if k not in saved]
    extra = [k for k in saved if k not in expected]
    if missing:
        parts.append(f"{len(missing)} of the model's keys are not in it (first: {missing[0]})")
    if extra:
        parts.append(f"{len(extra)} of its keys are not in the model (first: {extra[0]})")
    shaped = [k for k in expected if k in saved and isinstance(saved[k], torch.Tensor)
              and isinstance(expected[k], torch.Tensor) and tuple(saved[k].shape) != tuple(expected[k].shape)]
    if shaped:
        k = shaped[0]
        parts.append(f"{len(shaped)} shape(s) differ (first: {k} is {tuple(saved[k].shape)} in the checkpoint, "
                     f"{tuple(expected[k].shape)} in the model)")
    return "; ".join(parts) or None


def _validate(p: Path, state: Any, required: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {p} is not an oomtune checkpoint")
    if state.get("version") != VERSION:
        raise CheckpointError(f"checkpoint {p} has format version {state.get('version')!r}; this oomtune reads "
                              f"version {VERSION}")
    missing = [k for k in required if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {p} is incomplete: no {', '.join(missing)}")
    wrong = field_problem(state)
    if wrong is not None:  # (made or edited by hand: caught here, not as a bare error deep in the resume)
        raise CheckpointError(f"checkpoint {p} is not one oomtune wrote: {wrong}")
    return state

