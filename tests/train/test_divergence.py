"""oomtune train on a NaN / infinite loss: it stops before the step's update, keeps the last finite step (not one
whose buffers took the NaN), writes strict JSON, and leaves fp16's skipped steps alone. The `cpu` device, a tiny
model, a few steps (tests/train/cases.py)."""

from __future__ import annotations

import errno
import math
import os

import pytest
import torch
import yaml

from oomtune.train.checkpoint import list_checkpoints, load_checkpoint, stale_temp_files
from oomtune.train.rundir import RunLog

from ..conftest import events, metrics, run_cli
from .cases import error_line, losses, steps_saved, train

# -- a NaN / infinite loss ---------------------------------------------------------------------------------------

def test_a_nan_loss_stops_before_its_update_keeps_the_checkpoints_and_a_resume_continues_exactly(case_dir):
    assert train("--run-dir", "ref").exit_code == 0
    (case_dir / "nan-at").write_text("15")  # step 8's first micro-batch
    result = train()
    assert result.exit_code == 1, result.stderr
    line = error_line(result)
    assert "the training loss is nan at step 8 (micro-batch 1 of 2)" in line
    assert "ckpt-00000007.pt (step 7)" in line and "lower --lr" in line and "--resume" in line
    run = case_dir / "run"
    assert steps_saved(run) == [3, 6, 7]  # the last finite step saved, the earlier ones kept, nothing diverged
    assert all(torch.isfinite(p).all() for p in load_checkpoint(run / "ckpt-00000007.pt")["model"].values())
    assert [r["step"] for r in metrics(run)] == list(range(1, 8))
    (diverged,) = events(run, "diverged")
    assert (diverged["step"], diverged["loss"], diverged["checkpoint"]) == (8, "nan", "ckpt-00000007.pt")

    # the same bad batch again right after the resume: the message says it may be the batch, not the checkpoint
    again = train("--resume")
    assert again.exit_code == 1
    assert "first step after run/ckpt-00000007.pt (step 7)" in error_line(again)
    assert "or the batch of step 8 does" in error_line(again) and steps_saved(run) == [3, 6, 7]

    # one bad batch (here: gone once the marker is) - the resume trains on from step 7 as if nothing happened
    (case_dir / "nan-at").unlink()
    assert train("--resume").exit_code == 0
    assert losses(run) == pytest.approx(losses(case_dir / "ref"), rel=1e-6)


def test_a_learning_rate_that_diverges_stops_with_exit_1_and_writes_no_nan(case_dir):
    result = train("--lr", "1e20", "--checkpoint-interval", "1", "--clip-grad-norm", "1e9")
    assert result.exit_code == 1, result.stderr
    line = error_line(result)
    assert "training diverged" in line and "lower --lr (now 1e+20)" in line
    run = case_dir / "run"
    rows = metrics(run)  # valid JSON all through
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
    assert max(int(s["step"]) for s in state["optimizer"]["state"].values()) < 8  # AdamW took fewer than 8
    assert events(tmp_path / "run", "diverged") == []
    assert all(math.isfinite(r["loss"]) for r in metrics(tmp_path / "run"))


def test_a_nan_that_reached_the_batchnorm_statistics_is_not_saved_as_the_last_finite_step(case_dir):
    model = case_dir / "model.py"
    model.write_text(model.read_text()
                     .replace("self.drop = nn.Dropout(0.1)", "self.drop = nn.Dropout(0.1)\n        self.bn = "
                              "nn.BatchNorm1d(8)")
                     .replace("        for b in self.blocks:", "        x = self.bn(x)\n        for b in self.blocks:"))
    (case_dir / "nan-at").write_text("15")  # step 8's first micro-batch: its forward puts the NaN in running_mean
    result = train()
    assert result.exit_code == 1, result.stderr
    line = error_line(result)
    assert "reached the model's buffer bn.running_mean" in line and "ckpt-00000006.pt (step 6)" in line
    run = case_dir / "run"
    assert steps_saved(run) == [3, 6]  # step 7 in memory has NaN statistics: not saved as if it were good
    for step in (3, 6):
        state = load_checkpoint(run / f"ckpt-{step:08d}.pt")["model"]
        assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def test_a_divergence_whose_checkpoint_cannot_be_written_still_says_it_diverged(case_dir, monkeypatch):
    import oomtune.train.checkpoint as ckpt

    real_replace, renames = ckpt.os.replace, []

    def replace(src, dst, **dir_fds):  # the third checkpoint (step 7, saved because step 8 diverged) meets a full disk
        renames.append(dst)
        if sum(str(r).endswith(".pt") for r in renames) == 3 and str(dst).endswith(".pt"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_replace(src, dst, **dir_fds)

    monkeypatch.setattr(ckpt.os, "replace", replace)
    (case_dir / "nan-at").write_text("15")
    result = train()
    assert result.exit_code == 1, result.stderr
    line = error_line(result)
    assert "the training loss is nan at step 8" in line and "Step 7 could not be saved" in line
    assert "the disk is full" in line
    run = case_dir / "run"
    assert steps_saved(run) == [3, 6] and stale_temp_files(run) == []
    assert [e["step"] for e in events(run, "diverged")] == [8]
