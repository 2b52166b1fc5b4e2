"""The run directory: checked before anything is built, held by one run at a time (.oomtune.lock), and its log
files: metrics.jsonl (one JSON object per logged step) and events.jsonl (start, resume, checkpoints, OOM fallbacks,
config updates, divergence, errors, interruption, finish).

Both files are strict JSON, one object a line: a number that is not finite (a NaN or infinite loss) is written as
null, never as the bare `NaN` / `Infinity` tokens Python's json module would write and other readers reject."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from ..errors import BAD_INPUT, NO_FIT, OomtuneError
from ..files import (
    NotAFileError,
    append_line,
    atomic_write,
    nearest_existing,
    refuse_unless_file,
    try_write_in,
    what_stands,
)
from ..units import utc_now
from .checkpoint import latest_checkpoint, planted, remove, stale_temp_files

try:
    import fcntl
except ImportError:  # (not POSIX: no lock, as before)
    fcntl = None

METRICS = "metrics.jsonl"  # one JSON object per logged step: step, loss, lr, tokens_per_s, peak_bytes[, eval_loss]
EVENTS = "events.jsonl"  # start / resume / oom_fallback / config_updated / checkpoint / diverged / error / ...
LOCK = ".oomtune.lock"  # the pid of the run holding the run dir (whose folder it flock'd: let go at its end)


def check_run_dir(run_dir: Path) -> None:
    """Bad input, before any model is built: a run dir (or a folder above it) that is a file, or one that cannot be
    created or written. Writes nothing that stays: a probe file in the nearest existing folder, deleted at once."""
    folder = nearest_existing(run_dir)
    mine = folder == run_dir
    if not folder.is_dir():
        what = "is a file" if mine else f"cannot be created: {folder} is a file"
        raise OomtuneError(f"run dir {run_dir} {what}, not a folder; pass --run-dir with a folder", BAD_INPUT)
    try:
        try_write_in(folder)
    except OSError as e:
        where = "" if mine else f" (in {folder})"
        raise OomtuneError(f"run dir {run_dir} cannot be written{where}: {(e.strerror or str(e)).lower()}; pass "
                           "--run-dir with a folder you can write", BAD_INPUT) from None
    if mine:
        refuse_planted(run_dir)


def refuse_planted(run_dir: Path) -> None:
    """NotAFileError where a symbolic link (or a pipe, a device, a folder) stands under a name oomtune writes in the
    run dir: its logs, its lock, a checkpoint's. oomtune never makes one; writing or pruning would go through it."""
    for name in (METRICS, EVENTS, LOCK):
        refuse_unless_file(run_dir / name)
    link = planted(run_dir)
    if link is not None:
        refuse_unless_file(link)


def open_run_dir(run_dir: Path) -> None:
    """Make the run dir."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OomtuneError(f"run dir {run_dir} cannot be created: {(e.strerror or str(e)).lower()}",
                           BAD_INPUT) from None


def run_dir_user(run_dir: Path) -> int | None:
    """The pid of the `oomtune train` writing `run_dir` now (it holds the folder's lock), else None; 0 where its pid
    is not known. Two runs in one run dir interleave their metrics and rotate each other's checkpoints."""
    if fcntl is None:
        return None
    try:
        fd = os.open(run_dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:  # no run dir yet
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _pid_in(run_dir)
    except OSError:  # a file system without flock
        return None
    finally:
        os.close(fd)
    return None


class Held:
    """The run dir's lock: an open descriptor of the folder itself, flock'd. A lock on the folder, not on a file
    in it, cannot be undone by deleting a file (a deleted .oomtune.lock let a second run in beside a live one)."""

    def __init__(self, fd: int):
        self.fd = fd

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # (closing the descriptor lets go of its flock)
            self.fd = None


_HELD: list[Held] = []  # the locks this process holds: a child it forks (a DataLoader worker) lets go of its copy


def _forked() -> None:
    for held in _HELD:
        held.close()  # (the child's descriptor only: the flock stays with the parent's)
    _HELD.clear()


if fcntl is not None:
    os.register_at_fork(after_in_child=_forked)


def hold_run_dir(run_dir: Path, tries: int = 5) -> Held | None:
    """Take the run dir's lock for this process (a flock on the folder, held to the run's end; its pid written to
    .oomtune.lock for others to name); one line, exit 2, where a live run holds it (after `tries` 0.1 s apart:
    another process's run_dir_user holds it for a moment), or where a link, a pipe or a folder stands at
    .oomtune.lock. None where it cannot be had at all (no fcntl; a file system without flock: Lustre without -o
    flock, some NFS mounts): the run goes on unlocked, as before."""
    if fcntl is None:
        return None
    refuse_unless_file(run_dir / LOCK)
    held = Held(os.open(run_dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)))
    for attempt in range(tries):
        try:
            fcntl.flock(held.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if attempt == tries - 1:
                held.close()
                raise OomtuneError(in_use_message(run_dir, _pid_in(run_dir)), BAD_INPUT) from None
            time.sleep(0.1)
        except OSError:  # ENOSYS, ENOLCK, EOPNOTSUPP: no locks on this file system
            held.close()
            return None
    try:
        atomic_write(run_dir / LOCK, f"{os.getpid()}\n")
    except NotAFileError:
        held.close()
        raise
    except OSError:  # (another user's shared run dir, read-only for the pid: the lock holds all the same)
        pass
    _HELD.append(held)
    return held


def in_use_message(run_dir: Path, pid: int) -> str:
    if pid == os.getpid():  # (a notebook: an earlier train() of this process whose run has not let go)
        by = " in this process (an earlier run that has not ended)"
    else:
        by = f" (pid {pid})" if pid else ""
    return (f"run dir {run_dir} is in use by another oomtune train{by}: two runs would interleave their logs and "
            "checkpoints; wait for it to end, or pass --run-dir for a new run")


def _pid_in(run_dir: Path) -> int:
    """The pid in the run dir's .oomtune.lock (read without following a link or waiting on a pipe), else 0."""
    try:
        if what_stands(run_dir / LOCK) is not None:
            return 0
        with open(run_dir / LOCK, "rb") as f:
            return int(f.read(64).decode().strip() or 0)
    except (OSError, ValueError, UnicodeDecodeError):
        return 0


def no_checkpoint_message(run_dir: Path) -> str:
    """What `--resume` says when `run_dir` has no checkpoint, with a way out."""
    if (run_dir / METRICS).exists():
        steps = _steps_logged(run_dir / METRICS)
        why = (f"logged steps up to {steps} but holds no checkpoint (ckpt-*): they were deleted, or it stopped "
               "before its first one" if steps else "stopped before its first checkpoint (ckpt-*)")
        return (f"--resume: the run in {run_dir} {why}, so it cannot be resumed: delete {run_dir / METRICS} and "
                "start it over without --resume, or pass --run-dir for a new run")
    gone = "" if run_dir.exists() else ", which does not exist"
    return f"--resume: no checkpoint (ckpt-*) in run dir {run_dir}{gone}; start a run without --resume, or pass the " \
           "--run-dir of one"


def _steps_logged(metrics: Path) -> int | None:
    """The last step metrics.jsonl logged (None where it cannot be read)."""
    try:
        lines = metrics.read_text(encoding="utf-8").strip().splitlines()
        return int(json.loads(lines[-1])["step"]) if lines else None
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float (NaN, +-inf) replaced by None: strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class RunLog:
    """Appends to the run dir's metrics.jsonl and events.jsonl (on several ranks, rank 0 alone: `enabled`)."""

    def __init__(self, run_dir: Path, enabled: bool = True):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.lock = None  # the run dir's lock file, held while this run writes it (rank 0)

    def open(self, clean: bool, fresh: bool = False) -> None:
        """Make the run dir and, where this rank writes it, take its lock until `release`; then `clean`: delete the
        temp files a killed checkpoint write left (never a checkpoint; not before the lock: a live run's own).
        `fresh` (not a resume): a run that started and ended while this one was being built left its files: refused
        as check_inputs refuses them."""
        open_run_dir(self.run_dir)
        refuse_planted(self.run_dir)  # (again: one may have been put there while the model was built)
        if self.enabled:
            self.lock = hold_run_dir(self.run_dir)
            latest = latest_checkpoint(self.run_dir) if fresh else None
            if fresh and (latest is not None or (self.run_dir / METRICS).exists()):
                self.release()
                held = latest.name if latest is not None else METRICS
                raise OomtuneError(f"run dir {self.run_dir} already holds a run ({held}), which another train wrote "
                                   "while this one started: pass --resume to continue it, or --run-dir for a new one",
                                   BAD_INPUT)
        if clean:
            for tmp in stale_temp_files(self.run_dir):
                remove(tmp)

    def release(self) -> None:
        if self.lock is not None:
            if self.lock in _HELD:
                _HELD.remove(self.lock)
            self.lock.close()
            self.lock = None

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _append(self, name: str, record: dict) -> None:
        path = self.run_dir / name
        try:
            append_line(path, json.dumps(json_safe(record), allow_nan=False) + "\n")
        except OSError as e:  # a full disk, a run dir gone read-only
            raise OomtuneError(f"could not write {path}: {(e.strerror or str(e)).lower()}", NO_FIT) from None

    def event(self, kind: str, always: bool = False, **fields) -> None:
        """`always`: written by this rank even when it is not rank 0 (it alone knows, and the others are stopped)."""
        if self.enabled or always:
            self._append(EVENTS, {"time": utc_now(), "event": kind, **fields})

    def metrics(self, metrics: dict) -> None:
        if self.enabled:
            self._append(METRICS, metrics)

    def truncate_metrics(self, step: int) -> None:
        """On resume, drop lines past the checkpoint's `step` (written after it by the run that was killed), so
        metrics.jsonl reads as one run."""
        path = self.run_dir / METRICS
        if not self.enabled or not path.exists():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except (json.JSONDecodeError, AttributeError):
                continue  # a line cut short by a kill
        try:
            atomic_write(path, "".join(k + "\n" for k in kept))
        except OSError as e:  # a full disk: the old file is whole (the temp one is gone)
            raise OomtuneError(f"could not write {path}: {(e.strerror or str(e)).lower()}", NO_FIT) from None
