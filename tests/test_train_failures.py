"""oomtune train when something goes wrong mid-run or around it: a NaN / infinite loss, a model-file hook that
fails after some steps, a run dir that cannot be used, a full disk, a broken checkpoint, and the small cases
(nothing left to do, a budget smaller than the weights, a hook returning the wrong thing). Each is one line, an
exit code, and a run dir that `--resume` (or a fresh run) can go on from.

Every run here is on the `cpu` device, a tiny model, a few steps."""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path

import pytest
import torch
import yaml

from oomtune.checkpoint import list_checkpoints, load_checkpoint, stale_temp_files
from oomtune.rundir import RunLog

from .conftest import events, metrics, run_cli

# Dropout and seeded data: a resume is exact. Marker files next to the model make chosen draws go wrong:
# `nan-at` (a draw whose inputs hold a NaN), `fail-at` (a draw that raises).
MODEL = '''
from pathlib import Path
import torch
from torch import nn

DRAWS = [0]
HERE = Path(__file__).parent

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.out = nn.Linear(16, 4)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, y):
        for b in self.blocks:
            x = self.drop(torch.relu(b(x)))
        return nn.functional.cross_entropy(self.out(x).mean(1), y)

def build_model():
    return Net()

def make_batch(batch_size, context_length, device):
    return (torch.randn(batch_size, context_length, 16, device=device),
            torch.randint(0, 4, (batch_size,), device=device))

def _at(name):
    p = HERE / name
    return int(p.read_text()) if p.exists() else None

def train_batches(batch_size, context_length, device):
    while True:
        DRAWS[0] += 1
        if DRAWS[0] == _at("fail-at"):
            raise ValueError("the data server went away")
        x = torch.randn(batch_size, context_length, 16, device=device)
        if DRAWS[0] == _at("nan-at"):
            x[0, 0, 0] = float("nan")
        yield x, (x.sum((1, 2)) > 0).long()
'''

PLAN = {"micro_batch_size": 2, "context_length": 8, "grad_accum_steps": 2}  # 2 draws a step


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def model_dir(tmp_path, monkeypatch, write_model):
    monkeypatch.chdir(tmp_path)
    model = write_model(MODEL)
    (tmp_path / "best.yaml").write_text(yaml.safe_dump(
        {"model": str(model), "plan": PLAN, "train": {"steps": 10, "seed": 3, "warmup_steps": 2, "lr": 0.003,
                                                      "log_every_n_steps": 1, "checkpoint_interval": 3,
                                                      "run_dir": "run"}}, sort_keys=False))
    return tmp_path


def train(*args):
    return run_cli("train", "--config", "best.yaml", "--device", "cpu", "--budget", "1GiB", *args)


def error_line(result) -> str:
    lines = [" ".join(x.split()) for x in result.stderr.split("\n\n") if x.strip().startswith("error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def strict_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl read as strict JSON: a bare NaN / Infinity token fails."""
    def refuse(token):
        raise ValueError(f"{token} is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[float]:
    return [x for r in metrics(run_dir) for x in (r["step"], r["loss"], r["lr"])]


def steps_saved(run_dir: Path) -> list[int]:
    return [step for step, _ in list_checkpoints(run_dir)]


# -- a NaN / infinite loss ---------------------------------------------------------------------------------------

def test_a_nan_loss_stops_before_its_update_keeps_the_checkpoints_and_a_resume_continues_exactly(model_dir):
    assert train("--run-dir", "ref").exit_code == 0
    (model_dir / "nan-at").write_text("15")  # step 8's first micro-batch
    result = train()
    assert result.exit_code == 1, result.stderr
    line = error_line(result)
    assert "the training loss is nan at step 8 (micro-batch 1 of 2)" in line
    assert "ckpt-00000007.pt (step 7)" in line and "lower --lr" in line and "--resume" in line
    run = model_dir / "run"
    assert steps_saved(run) == [3, 6, 7]  # the last finite step saved, the earlier ones kept, nothing diverged
    assert all(torch.isfinite(p).all() for p in load_checkpoint(run / "ckpt-00000007.pt")["model"].values())
    assert [r["step"] for r in strict_rows(run)] == list(range(1, 8))
    (diverged,) = events(run, "diverged")
    assert (diverged["step"], diverged["loss"], diverged["checkpoint"]) == (8, "nan", "ckpt-00000007.pt")

    # the same bad batch again right after the resume: the message says it may be the batch, not the checkpoint
    again = train("--resume")
    assert again.exit_code == 1
    assert "first step after run/ckpt-00000007.pt (step 7)" in error_line(again)
    assert "or the batch of step 8 does" in error_line(again) and steps_saved(run) == [3, 6, 7]

    # one bad batch (here: gone once the marker is) - the resume trains on from step 7 as if nothing happened
    (model_dir / "nan-at").unlink()
    assert train("--resume").exit_code == 0
    assert losses(run) == pytest.approx(losses(model_dir / "ref"), rel=1e-6)


def test_a_learning_rate_that_diverges_stops_with_exit_1_and_writes_no_nan(model_dir):
    result = train("--lr", "1e20", "--checkpoint-interval", "1", "--clip-grad-norm", "1e9")
    assert result.exit_code == 1, result.stderr
    line = error_line(result)
    assert "training diverged" in line and "lower --lr (now 1e+20)" in line
    run = model_dir / "run"
    rows = strict_rows(run)  # valid JSON all through
    (diverged,) = events(run, "diverged")
    assert steps_saved(run)[-1] == diverged["step"] - 1 == rows[-1]["step"]  # no checkpoint of a diverged step
    for _, path in list_checkpoints(run):
        assert all(torch.isfinite(p).all() for p in load_checkpoint(path)["model"].values())

    # that last finite step is too far gone already (the loss does not depend on the lr): the resume says so
    result = train("--resume", "--lr", "1e-3")
    assert result.exit_code == 1
    said = error_line(result)
    assert f"move ckpt-{diverged['step'] - 1:08d}.pt out of run to resume from an older checkpoint" in said


def test_metrics_and_events_never_hold_nan_or_infinity_tokens(tmp_path):
    log = RunLog(tmp_path)
    log.metrics({"step": 1, "loss": 2.5, "eval_loss": float("nan"), "lr": float("inf")})
    log.event("x", values=[1.0, float("-inf")])
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 2.5, "eval_loss": null, "lr": null}\n'
    assert '"values": [1.0, null]' in (tmp_path / "events.jsonl").read_text()


FP16_MODEL = '''
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)  # fp16 under autocast
        return nn.functional.mse_loss(x.float(), y) + x.sum() * 2  # d/dx = 2 x scale: fp16 overflows at first

def build_model():
    return Net()

def make_batch(batch_size, context_length, device):
    return (torch.randn(batch_size, context_length, 8, device=device),
            torch.randn(batch_size, context_length, 8, device=device))
'''


def test_fp16_steps_the_grad_scaler_skips_for_inf_gradients_are_not_a_divergence(tmp_path, monkeypatch, write_model):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({
        "model": str(write_model(FP16_MODEL)), "plan": {"micro_batch_size": 2, "context_length": 4,
                                                        "precision": "fp16"},
        "train": {"steps": 8, "log_every_n_steps": 1, "run_dir": "run"}}))
    result = run_cli("train", "--config", "c.yaml", "--device", "cpu", "--budget", "1GiB")
    assert result.exit_code == 0, result.stderr
    state = load_checkpoint(tmp_path / "run" / "ckpt-00000008.pt")
    assert state["scaler"]["scale"] < 2.0**16  # steps were skipped: the scale dropped
    assert {int(s["step"]) for s in state["optimizer"]["state"].values()} < {8} | set(range(8))
    assert events(tmp_path / "run", "diverged") == []
    assert all(math.isfinite(r["loss"]) for r in strict_rows(tmp_path / "run"))


# -- a model-file hook failing mid-run ---------------------------------------------------------------------------

def test_a_train_batches_error_mid_run_saves_the_last_finished_step_and_resume_goes_on(model_dir):
    assert train("--run-dir", "ref").exit_code == 0
    (model_dir / "fail-at").write_text("11")  # step 6's first draw; the interval checkpoint is at 3
    result = train("--checkpoint-interval", "100", "--run-dir", "run")
    assert result.exit_code == 2, result.stderr
    line = error_line(result)
    assert "train_batches() raised ValueError: the data server went away (at step 6)" in line
    assert "ckpt-00000005.pt (step 5" in line and "--resume" in line
    run = model_dir / "run"
    assert steps_saved(run) == [5]
    (error,) = events(run, "error")
    assert (error["step"], error["phase"], error["checkpoint"]) == (6, "data", "ckpt-00000005.pt")

    (model_dir / "fail-at").unlink()
    assert train("--run-dir", "run", "--resume", "--checkpoint-interval", "3").exit_code == 0
    assert losses(run) == pytest.approx(losses(model_dir / "ref"), rel=1e-6)


def test_an_empty_eval_batches_at_the_first_evaluation_saves_that_step(model_dir):
    model = model_dir / "model.py"
    model.write_text(model.read_text() + "\ndef eval_batches(batch_size, context_length, device):\n    return []\n")
    result = train("--eval-interval", "2", "--checkpoint-interval", "100")
    assert result.exit_code == 2
    line = error_line(result)
    assert "eval_batches() yielded no batches" in line and "ckpt-00000002.pt (step 2" in line
    assert steps_saved(model_dir / "run") == [2]


EVAL_THAT_FAILS = '''
def eval_batches(batch_size, context_length, device):
    if (HERE / "eval-fail").exists():
        raise ValueError("the eval server went away")
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randn(batch_size, context_length, 16, generator=g)
        yield x, (x.sum((1, 2)) > 0).long()
'''


def test_an_eval_draw_error_is_after_its_step_and_the_resume_is_exact(model_dir):
    model = model_dir / "model.py"
    model.write_text(model.read_text() + EVAL_THAT_FAILS)
    assert train("--run-dir", "ref", "--eval-interval", "2").exit_code == 0
    (model_dir / "eval-fail").write_text("1")
    result = train("--eval-interval", "2", "--checkpoint-interval", "100")
    assert result.exit_code == 2, result.stderr
    assert "(at step 2)" in error_line(result)  # step 2 had finished: its evaluation failed
    (error,) = events(model_dir / "run", "error")
    assert (error["step"], error["phase"]) == (2, "eval-data")
    assert steps_saved(model_dir / "run") == [2]
    (model_dir / "eval-fail").unlink()
    assert train("--resume", "--eval-interval", "2", "--checkpoint-interval", "3").exit_code == 0
    after = [r for r in metrics(model_dir / "run") if r["step"] > 2]  # step 2's own row died with its evaluation
    ref = [r for r in metrics(model_dir / "ref") if r["step"] > 2]
    assert [r["step"] for r in after] == [r["step"] for r in ref] == list(range(3, 11))
    assert [r["loss"] for r in after] == pytest.approx([r["loss"] for r in ref], rel=1e-6)


def test_a_nan_that_reached_the_batchnorm_statistics_is_not_saved_as_the_last_finite_step(model_dir):
    model = model_dir / "model.py"
    model.write_text(model.read_text()
                     .replace("self.drop = nn.Dropout(0.1)", "self.drop = nn.Dropout(0.1)\n        self.bn = "
                              "nn.BatchNorm1d(8)")
                     .replace("        for b in self.blocks:", "        x = self.bn(x)\n        for b in self.blocks:"))
    (model_dir / "nan-at").write_text("15")  # step 8's first micro-batch: its forward puts the NaN in running_mean
    result = train()
    assert result.exit_code == 1, result.stderr
    line = error_line(result)
    assert "reached the model's buffer bn.running_mean" in line and "ckpt-00000006.pt (step 6)" in line
    run = model_dir / "run"
    assert steps_saved(run) == [3, 6]  # step 7 in memory has NaN statistics: not saved as if it were good
    for step in (3, 6):
        state = load_checkpoint(run / f"ckpt-{step:08d}.pt")["model"]
        assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def test_a_run_dir_without_a_checkpoint_says_how_to_start_over(model_dir):
    run = model_dir / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')  # a run killed before its first checkpoint
    line = error_line(train())
    assert "has no checkpoint to resume" in line and f"delete {Path('run') / 'metrics.jsonl'}" in line
    line = error_line(train("--resume"))
    assert "stopped before its first checkpoint" in line and "without --resume" in line
    assert error_line(train("--resume", "--run-dir", "nowhere")).endswith(
        "no checkpoint (ckpt-*) in run dir nowhere, which does not exist; start a run without --resume, or pass the "
        "--run-dir of one")
    (run / "metrics.jsonl").unlink()
    assert train("--steps", "2").exit_code == 0


# -- the run dir and the disk ------------------------------------------------------------------------------------

def test_a_run_dir_that_is_a_file_empty_or_unwritable_is_one_line_and_exit_2(model_dir, monkeypatch):
    (model_dir / "notes.txt").write_text("mine")
    for run_dir, needle in [("notes.txt", "run dir notes.txt is a file, not a folder"),
                            ("notes.txt/run", "run dir notes.txt/run cannot be created: notes.txt is a file"),
                            ("", "--run-dir must not be empty")]:
        result = train("--run-dir", run_dir)
        assert result.exit_code == 2, result.stderr
        assert needle in error_line(result)
    assert (model_dir / "notes.txt").read_text() == "mine"

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    built = []
    monkeypatch.setattr("oomtune.rundir.tempfile.mkstemp", read_only)
    monkeypatch.setattr("oomtune.train.build_training", lambda *a, **k: built.append(1))
    result = train("--run-dir", "sub/run")
    assert result.exit_code == 2
    assert error_line(result) == ("error: run dir sub/run cannot be written (in .): read-only file system; pass "
                                  "--run-dir with a folder you can write")
    assert built == [] and not (model_dir / "sub").exists()  # checked before the model is built


@pytest.mark.parametrize("failure", ["torch", "enospc"])
def test_a_full_disk_while_writing_a_checkpoint_is_one_line_and_the_earlier_checkpoints_stay(model_dir, monkeypatch,
                                                                                            failure):
    import oomtune.checkpoint as ckpt

    real_save, real_replace, calls = ckpt.torch.save, ckpt.os.replace, []

    def save(obj, f, *args, **kwargs):  # the second checkpoint: torch's own error for a write that fell short
        calls.append(1)
        if len(calls) == 2 and failure == "torch":
            f.write(b"PK\x03\x04 partial")
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4416 vs 4310")
        return real_save(obj, f, *args, **kwargs)

    def replace(src, dst):
        if len(calls) == 2 and failure == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt.torch, "save", save)
    monkeypatch.setattr(ckpt.os, "replace", replace)
    result = train()
    assert result.exit_code == 1, result.stderr
    line = error_line(result)
    assert line.startswith(f"error: could not write checkpoint {Path('run') / 'ckpt-00000006.pt'}: ")
    assert ("the disk is full" if failure == "enospc" else "unexpected pos") in line
    assert line.endswith("the earlier checkpoints are intact: ckpt-00000003.pt")
    run = model_dir / "run"
    assert steps_saved(run) == [3] and stale_temp_files(run) == []
    assert load_checkpoint(run / "ckpt-00000003.pt")["step"] == 3
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    monkeypatch.setattr(ckpt.os, "replace", real_replace)
    assert train("--resume").exit_code == 0  # once there is room again


# -- broken checkpoints on --resume ------------------------------------------------------------------------------

def test_a_broken_latest_checkpoint_is_named_in_plain_words_and_the_older_intact_one_offered(model_dir, write_model):
    assert train("--steps", "6").exit_code == 0
    run = model_dir / "run"
    latest = run / "ckpt-00000006.pt"
    good = latest.read_bytes()
    for data, needle in [(good[: len(good) // 3], "is truncated or damaged"),
                         (b"not a checkpoint at all\n", "is not a checkpoint: 24 bytes"),
                         (b"", "is empty (0 bytes)")]:
        latest.write_bytes(data)
        result = train("--resume")
        assert result.exit_code == 2
        line = error_line(result)
        assert line.startswith(f"error: checkpoint {latest.relative_to(model_dir)} {needle}"), line
        assert line.endswith(f"An older checkpoint is intact, ckpt-00000003.pt: move ckpt-00000006.pt out of "
                             f"{Path('run')} and rerun with --resume to continue from it")
        assert latest.read_bytes() == data  # never touched
    latest.write_bytes(good)

    other = write_model(MODEL.replace("nn.Linear(16, 4)", "nn.Linear(16, 5)").replace("range(2)", "range(3)"),
                        name="other.py")
    (model_dir / "other.yaml").write_text(yaml.safe_dump({"model": str(other), "plan": PLAN,
                                                          "train": {"run_dir": "run"}}))
    result = run_cli("train", "--config", "other.yaml", "--device", "cpu", "--resume")
    assert result.exit_code == 2
    assert error_line(result).endswith("does not match other.py's model: 2 of the model's keys are not in it (first: "
                                       "blocks.2.weight); 2 shape(s) differ (first: out.weight is (4, 16) in the "
                                       "checkpoint, (5, 16) in the model)")


# -- the small cases ---------------------------------------------------------------------------------------------

def test_a_resume_already_past_steps_says_there_is_nothing_to_do(model_dir):
    assert train("--steps", "6").exit_code == 0
    result = train("--resume", "--steps", "3")
    assert result.exit_code == 0
    said = " ".join(result.stdout.split())
    assert "nothing to do: the run in run is at step 6, already at or past --steps 3" in said
    assert "trained" not in said


def test_a_budget_smaller_than_the_weights_is_bad_input(model_dir):
    result = train("--budget", "1KiB")
    assert result.exit_code == 2
    assert "the weights alone do not fit" in error_line(result)
    assert steps_saved(model_dir / "run") == []


def test_a_train_batches_that_returns_no_iterable_is_named(model_dir):
    model = model_dir / "model.py"
    model.write_text(model.read_text() + "\ndef train_batches(batch_size, context_length, device):\n    return 42\n")
    result = train()
    assert result.exit_code == 2
    assert error_line(result) == ("error: model.py: train_batches() returned 42 (int); expected an iterable of "
                                  "batches (a generator that yields them, or a list)")


def test_a_divergence_whose_checkpoint_cannot_be_written_still_says_it_diverged(model_dir, monkeypatch):
    import oomtune.checkpoint as ckpt

    real_replace, renames = ckpt.os.replace, []

    def replace(src, dst):  # the third checkpoint (step 7, saved because step 8 diverged) meets a full disk
        renames.append(dst)
        if len(renames) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", replace)
    (model_dir / "nan-at").write_text("15")
    result = train()
    assert result.exit_code == 1, result.stderr
    line = error_line(result)
    assert "the training loss is nan at step 8" in line and "Step 7 could not be saved" in line
    assert "the disk is full" in line
    run = model_dir / "run"
    assert steps_saved(run) == [3, 6] and stale_temp_files(run) == []
    assert [e["step"] for e in events(run, "diverged")] == [8]
