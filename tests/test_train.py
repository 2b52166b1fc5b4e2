"""oomtune train: it learns, it resumes exactly after SIGINT / SIGKILL, it survives an OOM mid-run, and bad
input is one line + exit 2 with no file of the user's touched.

Every run here is on the `cpu` device with torch at one thread (a 2-core CI box shared with other jobs is
many times slower with two spinning OpenMP threads), tiny models and few steps."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml

from oomtune.config.loading import load_config
from oomtune.config.schema import Config, Plan, TrainConfig
from oomtune.config.writing import dump_config
from oomtune.errors import ModelFileError
from oomtune.model_file import load_model_file
from oomtune.search.trial import run_trial
from oomtune.train.checkpoint import list_checkpoints, load_checkpoint, stale_temp_files
from oomtune.train.data import split_batch
from oomtune.train.recovery import smaller_plan
from oomtune.train.trainer import lr_at, train

from .conftest import EXAMPLES, events, metrics, run_cli

OOMTUNE = [str(Path(sys.executable).parent / "oomtune")]  # the installed command, as a user runs it
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# A model with dropout (the model's RNG) and data drawn from torch's and Python's RNGs (the data stream):
# a resume is only exact if every one of them is restored.
RESUME_MODEL = '''
import random
import torch
import torch.nn.functional as F
from torch import nn

V, C = 32, 48

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, C)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(C), nn.Linear(C, 2 * C), nn.GELU(), nn.Dropout(0.2), nn.Linear(2 * C, C))
            for _ in range(2))
        self.out = nn.Linear(C, V)

    def forward(self, x, y):
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return F.cross_entropy(self.out(h).flatten(0, 1), y.flatten())

def build_model():
    return Net()

def make_batch(batch_size, context_length, device):
    x = torch.randint(0, V, (batch_size, context_length))
    return x.to(device), ((x * 7 + 3) % V).to(device)

def train_batches(batch_size, context_length, device):
    while True:
        x, y = make_batch(batch_size, context_length, "cpu")
        shift = random.randrange(V)  # Python's RNG too
        yield ((x + shift) % V).to(device), ((y + shift) % V).to(device)

def eval_batches(batch_size, context_length, device):
    g = torch.Generator().manual_seed(0)
    while True:
        x = torch.randint(0, V, (batch_size, context_length), generator=g)
        yield x.to(device), ((x * 7 + 3) % V).to(device)
'''

# Attention-like mixing keeps a (B, T, T) tensor per block: memory grows with T^2, so a batch at full length
# needs far more than the short ones before it. The first SHORT batches are T // 8 long: with 2 batches a step,
# step 5 runs a short micro-batch (its gradients accumulate) and then runs out of memory in a long one.
GROWING_MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn

V, C, SHORT = 16, 16, 9

class Mix(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.v = nn.Linear(C, C), nn.Linear(C, C)

    def forward(self, h):
        a = torch.softmax(self.q(h) @ h.transpose(1, 2) / C ** 0.5, dim=-1)  # (B, T, T)
        return h + a @ self.v(h)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, C)
        self.blocks = nn.ModuleList(Mix() for _ in range(3))
        self.out = nn.Linear(C, V)

    def forward(self, x, y):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return F.cross_entropy(self.out(h).flatten(0, 1), y.flatten())

def build_model():
    return Net()

def make_batch(batch_size, context_length, device):
    x = torch.randint(0, V, (batch_size, context_length), device=device)
    return x, (x + 1) % V

def train_batches(batch_size, context_length, device):
    n = 0
    while True:
        yield make_batch(batch_size, context_length // 8 if n < SHORT else context_length, device)
        n += 1
'''


def write_config(path: Path, model: Path, plan: dict, train_cfg: dict) -> Path:
    path.write_text(yaml.safe_dump({"model": str(model), "plan": plan, "train": train_cfg}, sort_keys=False))
    return path


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


# -- pure pieces ---------------------------------------------------------------------------------------------

def test_smaller_plan_halves_the_micro_batch_and_keeps_the_global_batch():
    seq, plan = [], Plan(8, 64, grad_accum_steps=2)
    while plan is not None:
        seq.append((plan.micro_batch_size, plan.grad_accum_steps, plan.global_batch_size))
        plan = smaller_plan(plan)
    assert seq == [(8, 2, 16), (4, 4, 16), (2, 8, 16), (1, 16, 16)]
    assert smaller_plan(Plan(6, 8)).micro_batch_size == 3  # the largest divisor at most half: exact global batch
    assert (smaller_plan(Plan(5, 8)).micro_batch_size, smaller_plan(Plan(5, 8)).grad_accum_steps) == (1, 5)


def test_split_batch_cuts_every_batch_tensor_and_shares_the_rest():
    batch = {"x": torch.arange(24).view(8, 3), "y": torch.arange(8), "scale": torch.tensor(2.0)}
    parts = split_batch(batch, 8, 4)
    assert [p["y"].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert torch.equal(torch.cat([p["x"] for p in parts]), batch["x"])
    assert all(p["scale"] is batch["scale"] for p in parts)
    with pytest.raises(ModelFileError, match="no tensor whose first dimension is its batch size 8"):
        split_batch((torch.zeros(3, 8),), 8, 2)


def test_lr_warms_up_linearly_then_decays_along_a_cosine_to_min_lr():
    from oomtune.config.schema import TrainConfig

    cfg = TrainConfig(steps=110, lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(0, cfg) == pytest.approx(1 / 11)
    assert lr_at(9, cfg) == pytest.approx(10 / 11)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)  # half way down the cosine: (lr + min_lr) / 2
    assert lr_at(110, cfg) == pytest.approx(0.1)
    assert all(lr_at(s, cfg) > lr_at(s + 1, cfg) for s in range(10, 109))


# -- it learns -------------------------------------------------------------------------------------------

def test_tiny_gpt_learns_its_real_data_well_below_the_uniform_guess(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = write_config(tmp_path / "best.yaml", EXAMPLES / "tiny_gpt.py", {"micro_batch_size": 8, "context_length": 32},
                       {"steps": 200, "lr": 0.01, "min_lr": 0.001, "warmup_steps": 20, "eval_interval": 50,
                        "eval_steps": 8, "log_every_n_steps": 10, "checkpoint_interval": 200, "run_dir": "run"})
    notes = []
    result = train(cfg, device="cpu", on_event=notes.append)
    rows = metrics(tmp_path / "run")
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    uniform = math.log(256)
    print(f"tiny_gpt eval loss {evals} vs ln(256) = {uniform:.3f}")
    assert [r["step"] for r in rows if "eval_loss" in r] == [50, 100, 150, 200]
    assert evals[-1] < 0.6 * uniform  # well below guessing a byte uniformly
    assert evals[-1] < evals[0]
    assert result.step == 200 and result.eval_loss == evals[-1]
    assert not any(getattr(n, "warning", False) and "synthetic" in n.message for n in notes)  # real data
    assert [r["step"] for r in rows[:3]] == [1, 10, 20]  # the first step, then every log_every_n_steps
    assert rows[0]["loss"] == pytest.approx(uniform, rel=0.05)  # a fresh model guesses bytes about uniformly
    assert rows[0]["lr"] == pytest.approx(0.01 / 21) and rows[1]["lr"] == pytest.approx(0.01 * 10 / 21)
    assert rows[-1]["lr"] == pytest.approx(0.001, rel=0.05)
    assert all(set(r) >= {"step", "loss", "lr", "tokens_per_s", "peak_bytes"} for r in rows)


def test_a_model_file_without_train_batches_trains_on_synthetic_data_with_a_warning(tmp_path, write_model,
                                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = write_config(tmp_path / "c.yaml", write_model(), {"micro_batch_size": 2, "context_length": 4},
                       {"steps": 3, "run_dir": "run"})
    result = run_cli("train", "--config", cfg, "--device", "cpu")
    assert result.exit_code == 0, result.stderr
    assert "no train_batches(): training on make_batch(), random synthetic data" in result.stderr
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 3]


# -- exact resume after SIGINT and SIGKILL -------------------------------------------------------------------

RESUME_PLAN = {"micro_batch_size": 4, "context_length": 16, "grad_accum_steps": 2}
RESUME_STEPS = 150


def resume_config(tmp: Path, checkpoint_interval: int) -> Path:
    model = tmp / "resume_model.py"
    model.write_text(textwrap.dedent(RESUME_MODEL))
    return write_config(tmp / "resume.yaml", model, RESUME_PLAN,
                        {"steps": RESUME_STEPS, "lr": 0.003, "warmup_steps": 10, "eval_interval": 25, "eval_steps": 2,
                         "log_every_n_steps": 1, "checkpoint_interval": checkpoint_interval, "seed": 7})


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


# -- OOM mid-run -----------------------------------------------------------------------------------------------

GROW_PLAN = Plan(micro_batch_size=4, context_length=128, grad_accum_steps=2)


def peak(model: Path, plan: Plan) -> int:
    from oomtune.memory.devices import make_device

    result = run_trial(load_model_file(model), plan, make_device("cpu", "1GiB"), steps=2)
    assert not result.oom
    return result.peak_bytes


@pytest.fixture
def growing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "growing.py"
    model.write_text(textwrap.dedent(GROWING_MODEL))
    train_cfg = {"steps": 8, "lr": 0.01, "warmup_steps": 0, "log_every_n_steps": 1, "checkpoint_interval": 100,
                 "run_dir": "run"}
    cfg = tmp_path / "best.yaml"  # the block layout `oomtune probe` writes, plus a person's own comment
    text = dump_config(Config(model=str(model), plan=GROW_PLAN, train=TrainConfig(**train_cfg)))
    cfg.write_text(text.replace("train:\n", "train:\n  # a note of mine: keep lr high\n"))
    return model, cfg


def test_an_oom_mid_run_halves_the_micro_batch_keeps_the_global_batch_and_updates_the_config(growing, tmp_path):
    model, cfg = growing
    full, half = peak(model, GROW_PLAN), peak(model, smaller_plan(GROW_PLAN))
    short = peak(model, dataclasses.replace(GROW_PLAN, context_length=GROW_PLAN.context_length // 8))
    assert short < half < full  # the calibration this test relies on
    budget = (half + full) // 2  # the short batches fit at micro-batch 4, the full-length ones only at 2
    before, text_before = load_config(cfg), cfg.read_text()
    cfg.chmod(0o640)

    result = run_cli("train", "--config", cfg, "--device", "cpu", "--budget", str(budget))
    assert result.exit_code == 0, result.stderr
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, 9))  # the same number of optimizer steps
    assert [(r["micro_batch_size"], r["grad_accum_steps"]) for r in rows] == [(4, 2)] * 4 + [(2, 4)] * 4
    assert all(r["peak_bytes"] <= budget for r in rows)
    (fallback,) = events(tmp_path / "run", "oom_fallback")
    assert (fallback["step"], fallback["old_plan"]["micro_batch_size"], fallback["new_plan"]["micro_batch_size"]) \
        == (5, 4, 2)
    assert "out of memory" in result.stderr and "retrying the same batch" in result.stderr

    after = load_config(cfg)  # the next run starts from what worked
    assert (after.plan.micro_batch_size, after.plan.grad_accum_steps, after.plan.global_batch_size) == (2, 4, 8)
    assert (after.plan.context_length, after.train, after.model) == (before.plan.context_length, before.train,
                                                                     before.model)
    changed = set(cfg.read_text().splitlines()) ^ set(text_before.splitlines())
    assert "  # a note of mine: keep lr high" in cfg.read_text()  # edited in place: the person's comment stays
    assert cfg.stat().st_mode & 0o777 == 0o640  # and its permissions
    assert sorted(line.split(":")[0].strip() for line in changed) == [  # old and new of each, and a header
        "# plan updated by `oomtune train` at step 5", "grad_accum_steps", "grad_accum_steps", "micro_batch_size",
        "micro_batch_size"]
    state = load_checkpoint(list_checkpoints(tmp_path / "run")[-1][1])
    assert state["step"] == 8
    assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {8}  # AdamW stepped 8 times, no more

    # the retried step trained on the same batch: the run matches one that never ran out of memory
    ref_cfg = write_config(tmp_path / "ref.yaml", model, {"micro_batch_size": 4, "context_length": 128,
                                                          "grad_accum_steps": 2},
                           {**dataclasses.asdict(after.train), "run_dir": "ref"})
    assert run_cli("train", "--config", ref_cfg, "--device", "cpu", "--budget", "1GiB").exit_code == 0
    ref = metrics(tmp_path / "ref")
    assert [r["micro_batch_size"] for r in ref] == [4] * 8
    worst = max(abs(r["loss"] - q["loss"]) / q["loss"] for r, q in zip(rows, ref, strict=True))
    print(f"OOM fallback run vs a run that never ran out: largest relative loss difference {worst:.2g}")
    assert worst < 1e-5


def test_an_oom_at_micro_batch_1_stops_with_one_line_and_a_checkpoint(growing, tmp_path):
    model, cfg = growing
    short = peak(model, dataclasses.replace(GROW_PLAN, context_length=GROW_PLAN.context_length // 8))
    one = peak(model, Plan(1, GROW_PLAN.context_length, grad_accum_steps=8))
    assert short < one
    before = cfg.read_bytes()

    result = run_cli("train", "--config", cfg, "--device", "cpu", "--budget", str((short + one) // 2))
    assert result.exit_code == 1
    (line,) = [x for x in error_lines(result) if x.startswith("error:")]
    assert "out of memory at micro-batch 1 (step 5" in line and "ckpt-00000004.pt" in line
    state = load_checkpoint(tmp_path / "run" / "ckpt-00000004.pt")
    assert state["step"] == 4 and Plan(**state["plan"]) == GROW_PLAN  # the last plan that ran, to resume from
    assert [e["new_plan"]["micro_batch_size"] for e in events(tmp_path / "run", "oom_fallback")] == [2, 1]
    assert cfg.read_bytes() == before  # no plan worked, so none was written


# -- bad input: one line, exit 2, nothing of the user's overwritten ------------------------------------------

def assert_one_line_exit_2(result, *needles: str) -> None:
    assert result.exit_code == 2, result.stderr
    lines = error_lines(result)
    assert len(lines) == 1 and lines[0].startswith("error:"), lines
    for needle in needles:
        assert needle in lines[0]


def test_a_config_whose_model_file_is_gone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = write_config(tmp_path / "best.yaml", tmp_path / "gone.py", {"micro_batch_size": 2, "context_length": 4},
                       {"run_dir": "run"})
    before = cfg.read_bytes()
    assert_one_line_exit_2(run_cli("train", "--config", cfg), "model file not found", "gone.py")
    assert cfg.read_bytes() == before and not (tmp_path / "run").exists()


def test_a_train_key_with_a_wrong_type(tmp_path, write_model, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = write_config(tmp_path / "best.yaml", write_model(), {"micro_batch_size": 2, "context_length": 4},
                       {"steps": "ten", "run_dir": "run"})
    before = cfg.read_bytes()
    assert_one_line_exit_2(run_cli("train", "--config", cfg), "train.steps", "'ten'")
    assert cfg.read_bytes() == before and not (tmp_path / "run").exists()


def test_a_corrupt_or_foreign_checkpoint_on_resume_and_a_fresh_run_into_a_used_run_dir(tmp_path, write_model,
                                                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = resume_config(tmp_path, checkpoint_interval=3)
    assert run_cli("train", "--config", cfg, "--device", "cpu", "--steps", "3", "--run-dir", "run").exit_code == 0
    run_files = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()}
    other = write_config(tmp_path / "other.yaml", write_model(), RESUME_PLAN, {"run_dir": "run"})  # another model
    assert_one_line_exit_2(run_cli("train", "--config", other, "--device", "cpu", "--resume"),
                           "ckpt-00000003.pt", "does not match")
    assert {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()} == run_files

    ckpt = tmp_path / "run" / "ckpt-00000003.pt"
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 3])  # a torn copy
    snapshot = {p.name: p.read_bytes() for p in [cfg, *(tmp_path / "run").iterdir()]}

    assert_one_line_exit_2(run_cli("train", "--config", cfg, "--device", "cpu", "--run-dir", "run", "--resume"),
                           "ckpt-00000003.pt", "truncated")
    assert_one_line_exit_2(run_cli("train", "--config", cfg, "--device", "cpu", "--run-dir", "run"),
                           "already holds a run", "--resume")
    assert {p.name: p.read_bytes() for p in [cfg, *(tmp_path / "run").iterdir()]} == snapshot


def test_resume_needs_a_checkpoint(tmp_path, write_model, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = write_config(tmp_path / "best.yaml", write_model(), {"micro_batch_size": 2, "context_length": 4},
                       {"run_dir": "run"})
    assert_one_line_exit_2(run_cli("train", "--config", cfg, "--resume"), "no checkpoint")



def test_train_runs_where_the_plan_was_probed_unless_told_otherwise(tmp_path, write_model, monkeypatch):
    from oomtune.config.schema import FoundBy
    from oomtune.train.trainer import Trainer

    monkeypatch.chdir(tmp_path)
    found = FoundBy(command="probe", estimated=False, device="cpu", gpu_name="cpu", budget_bytes=12 * 2**20,
                    headroom=0.1, objective="fit", target_batch=2, target_context=4, min_context=4, peak_bytes=1,
                    tokens_per_s=None, torch_version="x", cuda_version=None, oomtune_version="x", date="x")
    cfg = tmp_path / "best.yaml"
    cfg.write_text(dump_config(Config(model=str(write_model()), plan=Plan(2, 4), train=TrainConfig(run_dir="run"),
                                      found_by=found)))
    assert Trainer(cfg).device.budget_bytes == 12 * 2**20  # the simulated card the plan was found for
    assert Trainer(cfg, budget="1GiB").device.budget_bytes == 2**30
    assert_one_line_exit_2(run_cli("train", "--config", cfg, "--device", "fake", "--budget", "1GiB"),
                           "needs a device that computes")
    assert not (tmp_path / "run").exists()
