"""oomtune train stopped by SIGINT saves a checkpoint, killed (SIGKILL) mid-write leaves the last checkpoint
whole, and either way a resume reproduces the uninterrupted run exactly. The installed command in a fresh process.

Every run here is on the `cpu` device with torch at one thread (a 2-core CI box shared with other jobs is
many times slower with two spinning OpenMP threads), tiny models and few steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from oomtune.train.checkpoint import list_checkpoints, load_checkpoint, stale_temp_files

from ..conftest import metrics
from .models import RESUME_STEPS, resume_config

OOMTUNE = [str(Path(sys.executable).parent / "oomtune")]  # the installed command, as a user runs it
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


# -- exact resume after SIGINT and SIGKILL -------------------------------------------------------------------

def oomtune(*args, cwd: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen([*OOMTUNE, *map(str, args)], cwd=cwd, env=CHILD_ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> list[dict]:
    """The uninterrupted run every resumed run must reproduce."""
    tmp = tmp_path_factory.mktemp("reference")
    cfg = resume_config(tmp, checkpoint_interval=50)
    proc = oomtune("train", "--config", cfg, "--device", "cpu", "--run-dir", tmp / "run", cwd=tmp)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    rows = metrics(tmp / "run")
    assert [r["step"] for r in rows] == list(range(1, RESUME_STEPS + 1))
    return rows


def assert_same_run(rows: list[dict], reference: list[dict]) -> float:
    """Same steps, same loss and eval loss at every step; returns the largest difference seen."""
    assert [r["step"] for r in rows] == [r["step"] for r in reference]
    worst = 0.0
    for r, ref in zip(rows, reference, strict=True):
        for key in ("loss", "eval_loss", "lr"):
            assert (key in r) == (key in ref)
            if key in r:
                worst = max(worst, abs(r[key] - ref[key]))
                assert r[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-7), (r["step"], key)
    return worst


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}: {proc.stderr.read()}")
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def last_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def test_sigint_saves_a_checkpoint_and_resume_reproduces_the_uninterrupted_run(tmp_path, reference_run):
    cfg = resume_config(tmp_path, checkpoint_interval=50)
    run = tmp_path / "run"
    proc = oomtune("train", "--config", cfg, "--device", "cpu", "--run-dir", run, cwd=tmp_path)
    wait_for(lambda: last_step(run) >= 10, 120, "step 10", proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    stopped = last_step(run)
    assert 10 <= stopped < RESUME_STEPS
    (ckpt_step, ckpt), *_ = reversed(list_checkpoints(run))
    assert ckpt_step == stopped  # saved on Ctrl-C, not only at the interval
    assert load_checkpoint(ckpt)["step"] == stopped

    proc = oomtune("train", "--config", cfg, "--device", "cpu", "--run-dir", run, "--resume", cwd=tmp_path)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    worst = assert_same_run(metrics(run), reference_run)
    print(f"SIGINT at step {stopped}; resumed run vs uninterrupted: largest |difference| {worst:.3g}")


def test_a_progress_reader_that_leaves_stops_the_progress_not_the_run(tmp_path, reference_run):
    """stderr's reader gone after the first line (`2>&1 | head -1`, a dead tee): the run died at its next progress
    line, exit 1, its finished steps in no checkpoint. Now it trains on unseen to the end: every step the same as
    the uninterrupted run's, the final checkpoint written, exit 0 (its stdout still had a reader)."""
    cfg = resume_config(tmp_path, checkpoint_interval=50)
    run = tmp_path / "run"
    proc = oomtune("train", "--config", cfg, "--device", "cpu", "--run-dir", run, cwd=tmp_path)
    assert proc.stderr.readline().startswith("training from scratch")
    proc.stderr.close()  # every later progress line meets a closed pipe
    proc.stdout.read()
    assert proc.wait(timeout=300) == 0
    assert_same_run(metrics(run), reference_run)
    assert [step for step, _ in list_checkpoints(run)][-1] == RESUME_STEPS
    assert json.loads((run / "events.jsonl").read_text().splitlines()[-1])["event"] == "finished"


KILL_DRIVER = '''
import io, os, sys, time
from pathlib import Path
import torch
import oomtune.train.checkpoint

marker, calls, real_save = Path(sys.argv[1]), [], torch.save

def save(obj, f, *args, **kwargs):
    """The second checkpoint write stops half way through its bytes, says so, and waits to be killed."""
    calls.append(1)
    if len(calls) < 2:
        return real_save(obj, f, *args, **kwargs)
    buf = io.BytesIO()
    real_save(obj, buf, *args, **kwargs)
    data = buf.getvalue()
    f.write(data[: len(data) // 2])
    f.flush()
    os.fsync(f.fileno())
    marker.with_suffix(".tmp").write_text(str(len(data)))
    marker.with_suffix(".tmp").rename(marker)  # the test sees the marker whole or not at all
    time.sleep(600)

oomtune.train.checkpoint.torch.save = save
from oomtune.cli import main
sys.argv = ["oomtune", *sys.argv[2:]]
main()
'''


def test_sigkill_during_a_checkpoint_write_leaves_the_last_checkpoint_whole_and_resume_is_exact(
        tmp_path, reference_run):
    cfg = resume_config(tmp_path, checkpoint_interval=10)
    run, marker = tmp_path / "run", tmp_path / "writing"
    driver = tmp_path / "driver.py"
    driver.write_text(KILL_DRIVER)
    proc = subprocess.Popen([sys.executable, str(driver), str(marker), "train", "--config", str(cfg), "--device",
                             "cpu", "--run-dir", str(run)], cwd=tmp_path, env=CHILD_ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for(marker.exists, 120, "the second checkpoint write", proc)
    proc.kill()  # SIGKILL: no handler, no cleanup
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL

    partial = stale_temp_files(run)
    assert len(partial) == 1 and partial[0].stat().st_size < int(marker.read_text())  # killed mid-write
    assert [step for step, _ in list_checkpoints(run)] == [10]  # the half-written one never took the name
    assert load_checkpoint(list_checkpoints(run)[0][1])["step"] == 10
    assert last_step(run) == 20  # metrics ran ahead of the last checkpoint

    proc = oomtune("train", "--config", cfg, "--device", "cpu", "--run-dir", run, "--resume", cwd=tmp_path)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert stale_temp_files(run) == []
    worst = assert_same_run(metrics(run), reference_run)  # steps 11-20 replayed once, not twice
    print(f"SIGKILL in the step-20 write; resumed from 10 vs uninterrupted: largest |difference| {worst:.3g}")




# -- probe and estimate: SIGTERM (a scheduler's, `timeout`'s) stops the search, says so and writes nothing --------

SLOW_MODEL = '''
import time
from pathlib import Path
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.lin(x).mean(1), y)

def build_model():
    return Net()

def make_batch(batch_size, context_length, device):
    (Path(__file__).parent / "searching").touch()
    time.sleep(0.2)
    return torch.randn(batch_size, context_length, 16, device=device), torch.randint(0, 4, (batch_size,), device=device)
'''


@pytest.mark.parametrize("command", ["probe", "estimate"])
def test_sigterm_stops_a_search_with_one_line_and_exit_143_and_no_config(command, tmp_path):
    (tmp_path / "model.py").write_text(SLOW_MODEL)
    out = tmp_path / "best.yaml"
    device = ("--device", "cpu") if command == "probe" else ("--margin", "0")
    proc = oomtune(command, tmp_path / "model.py", *device, "--budget", "64MiB", "--batch", "64", "--context", "8",
                   "--out", out, cwd=tmp_path)
    wait_for((tmp_path / "searching").exists, 120, "the first trial", proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "terminated (SIGTERM)" in stderr and "Traceback" not in stderr, stderr
    assert not out.exists()
