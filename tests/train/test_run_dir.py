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
