"""The run dir held by one run at a time, and a file in it that is no checkpoint. The `cpu` device, a tiny model
(tests/train/cases.py)."""

from __future__ import annotations

import pytest

from oomtune.train.checkpoint import load_checkpoint

from ..conftest import metrics
from .cases import error_line, train

HOLDER = """
import sys, time
from pathlib import Path
from oomtune.train.rundir import RunLog
log = RunLog(Path(sys.argv[1]))
log.open(clean=False)
print("held", flush=True)
time.sleep(120)
"""


def test_a_run_dir_another_live_run_holds_is_refused_with_its_pid_and_the_lock_dies_with_it(case_dir):
    """Two trains in one run dir both ran to exit 0, their metrics interleaved and each rotating the other's
    checkpoints (from a new user's pass). Another process holding the run dir (as a live train does from the
    moment it opens it) -> one line naming its pid, exit 2, nothing written; once it is gone, --resume goes on."""
    import subprocess
    import sys

    assert train("--steps", "4").exit_code == 0
    run = case_dir / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = {p.name: p.read_bytes() for p in run.iterdir()}
        for args in (("--resume",), ("--resume", "--steps", "6")):
            line = error_line(train(*args))
            assert line == (f"error: run dir run is in use by another oomtune train (pid {holder.pid}): two runs would "
                            "interleave their logs and checkpoints; wait for it to end, or pass --run-dir for a new "
                            "run")
        assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    finally:
        holder.kill()
        holder.wait()
    resumed = train("--resume", "--steps", "6")
    assert resumed.exit_code == 0, resumed.stderr
    assert [r["step"] for r in metrics(run)] == list(range(1, 7))
    again = train("--resume", "--steps", "7")  # this process let go of it when its run ended
    assert again.exit_code == 0, again.stderr


def test_a_pickle_that_is_no_checkpoint_is_one_line_without_torchs_protocol_warning(tmp_path):
    """A plain pickle named ckpt-*.pt printed torch's 'Detected pickle protocol 4' UserWarning (two lines) above the
    one-line error (from a new user's pass)."""
    import pickle
    import warnings

    from oomtune.train.checkpoint import CheckpointError

    path = tmp_path / "ckpt-00000009.pt"
    path.write_bytes(pickle.dumps({"a": 1}, protocol=4))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointError, match=r"ckpt-00000009\.pt is not a checkpoint"):
            load_checkpoint(path)
    assert [str(w.message) for w in said] == []


def test_the_lock_is_let_go_however_the_run_ends_and_a_forked_child_keeps_no_copy(case_dir):
    """A run that raises before its loop (here its on_event callback, on Started) let go of the lock only when the
    Trainer was collected: a notebook holding the exception was refused its next train() in that run dir ("in use"
    by its own pid). A child forked while a run holds it (a DataLoader worker) kept the flock after the run let
    go. Both from a review."""
    import os

    from oomtune.train.rundir import RunLog, run_dir_user
    from oomtune.train.trainer import train as train_api

    def refuse(event):
        if type(event).__name__ == "Started":
            raise RuntimeError("a callback that fails")

    with pytest.raises(RuntimeError, match="a callback that fails") as kept:
        train_api("best.yaml", overrides={"steps": 2}, device="cpu", budget="1GiB", on_event=refuse)
    assert kept.value is not None and run_dir_user(case_dir / "run") is None
    assert train_api("best.yaml", overrides={"steps": 2}, device="cpu", budget="1GiB").step == 2

    log = RunLog(case_dir / "run")
    log.open(clean=False)
    line = error_line(train("--resume", "--steps", "3"))
    assert "run dir run is in use by another oomtune train in this process (an earlier run that has not ended)" in line
    read, write = os.pipe()
    ready_read, ready_write = os.pipe()
    child = os.fork()
    if child == 0:  # the child (its fork hooks run) says it is there, holds on until told, then leaves at once
        os.write(ready_write, b"r")
        os.read(read, 1)
        os._exit(0)
    try:
        assert os.read(ready_read, 1) == b"r"
        log.release()
        assert run_dir_user(case_dir / "run") is None  # the child closed its copy when it was forked
    finally:
        os.write(write, b"x")
        os.waitpid(child, 0)


def test_a_file_system_without_flock_trains_unlocked(case_dir, monkeypatch):
    """Lustre without -o flock, some NFS mounts: flock raises ENOLCK / ENOSYS. Every train exited 1 there ("unexpected
    error", after building the model); it runs unlocked, as before the lock (from a review)."""
    import errno

    import oomtune.train.rundir as rundir

    def no_locks(f, how):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(rundir.fcntl, "flock", no_locks)
    result = train("--steps", "2")
    assert result.exit_code == 0, result.output
    assert [r["step"] for r in metrics(case_dir / "run")] == [1, 2]


def test_a_run_that_another_train_started_and_ended_meanwhile_is_refused_when_the_lock_is_taken(case_dir, monkeypatch):
    """The early check passed (an empty run dir), then another train wrote the run dir while this one built its model,
    and ended: this one took the free lock and trained beside that run's files. It is refused there now, with the
    same words as the early check, and the other run's file is left as it was."""
    import oomtune.train.trainer as trainer

    real = trainer.build_training

    def meanwhile(*args, **kwargs):
        (case_dir / "run").mkdir(exist_ok=True)
        (case_dir / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, "build_training", meanwhile)
    line = error_line(train("--steps", "2"))
    assert "run dir run already holds a run (metrics.jsonl), which another train wrote while this one started" in line
    assert (case_dir / "run" / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'
    assert sorted(p.name for p in (case_dir / "run").iterdir()) == [".oomtune.lock", "metrics.jsonl"]
