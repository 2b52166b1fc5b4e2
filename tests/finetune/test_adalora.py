"""PEFT AdaLoRA on the cpu device (real compute, simulated memory): the training step reallocates the adapters'
ranks on AdaLoRA's schedule (a loop that never calls update_and_allocate trains a fixed-rank adapter: no rank is
ever masked), with the offload lever too (its gradients are on the host), and a resume from the half-way
checkpoint carries the allocator's scores, so it masks what the uninterrupted run masked, to the bit. The probe's
trials take its scores into the peak: the fake device's equals the cpu device's to the byte."""

from __future__ import annotations

import json
import shutil
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
import yaml

from oomtune.model_file import load_model_file
from oomtune.rank_allocation import KEY
from oomtune.train.checkpoint import load_checkpoint
from oomtune.train.trainer import train

from ..conftest import run_cli

pytestmark = pytest.mark.skipif(find_spec("transformers") is None or find_spec("peft") is None,
                                reason="transformers and peft are not installed (pip install -e '.[dev]')")

MODEL = Path(__file__).parent / "models" / "hf_llama_adalora.py"
STEPS, HALF = 10, 5  # the model file's total_step, tinit 2, tfinal 2: ranks masked from step 3 on
MODULES, INIT_R, TARGET_R = 4, 4, 1  # q_proj and v_proj in 2 layers


def _train(where: Path, plan: dict, resume: bool = False) -> Path:
    cfg = where / "c.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": str(MODEL), "plan": {"micro_batch_size": 2, "context_length": 16, **plan},
        "train": {"steps": STEPS, "lr": 0.01, "warmup_steps": 1, "log_every_n_steps": 1, "checkpoint_interval": HALF,
                  "run_dir": str(where / "run")}}))
    train(cfg, device="cpu", resume=resume)
    return where / "run"


def _masked(state: dict) -> int:
    """Ranks masked: AdaLoRA zeroes the singular values (lora_E) of the ranks it prunes."""
    return sum(int((v == 0).sum()) for k, v in state.items() if ".lora_E." in k)


@pytest.mark.parametrize("plan", [{}, {"offload_optimizer": True}], ids=["plain", "offload"])
def test_ranks_are_reallocated_on_the_schedule_and_a_resume_allocates_as_the_whole_run(plan, tmp_path):
    torch.set_num_threads(1)
    (tmp_path / "whole").mkdir()
    whole = load_checkpoint(_train(tmp_path / "whole", plan) / f"ckpt-{STEPS:08d}.pt")
    half = load_checkpoint(tmp_path / "whole" / "run" / f"ckpt-{HALF:08d}.pt")
    budget_cut = MODULES * (INIT_R - TARGET_R)
    print(f"masked ranks: step {HALF} {_masked(half['model'])}, step {STEPS} {_masked(whole['model'])}")
    assert _masked(whole["model"]) == budget_cut  # the final budget: target_r per module
    assert 0 < _masked(half["model"]) < budget_cut  # mid-schedule: some masked, the budget shrinking
    pattern = whole[KEY]["rank_pattern"]
    assert len(pattern) == MODULES and sum(sum(p) for p in pattern.values()) == MODULES * TARGET_R

    again = tmp_path / "again"
    shutil.copytree(tmp_path / "whole", again)
    (again / "run" / f"ckpt-{STEPS:08d}.pt").unlink()
    resumed = load_checkpoint(_train(again, plan, resume=True) / f"ckpt-{STEPS:08d}.pt")
    assert resumed[KEY]["rank_pattern"] == pattern
    assert all(torch.equal(resumed["model"][k], v) for k, v in whole["model"].items())
    assert all(torch.equal(resumed[KEY]["exp_avg_unc"][k], v) for k, v in whole[KEY]["exp_avg_unc"].items())


def _probe_and_check(tmp_path: Path, name: str) -> tuple[dict, dict]:
    out = tmp_path / f"{name}.yaml"
    probe = run_cli("probe", MODEL, "--device", "cpu", "--budget", "64MiB", "--batch", "2", "--context", "16",
                    "--levers", "amp", "--out", out, "--json")
    assert probe.exit_code == 0, probe.output
    check = run_cli("check", "--config", out, "--json")  # the fake device: the first step's state made apart
    assert check.exit_code == 0, check.output
    return json.loads(probe.stdout), json.loads(check.stdout)


def test_the_probe_counts_the_allocator_scores_and_fake_equals_cpu(tmp_path, monkeypatch):
    """The scores are three fp32 copies of every adapter weight, kept from the first step on: a step that never
    allocates peaks lower by at least that much, on the cpu device (two real steps) and the fake one (the first
    step's state made without it) alike."""
    probed, checked = _probe_and_check(tmp_path, "adalora")
    assert checked["new_peak_bytes"] == probed["peak_bytes"]
    monkeypatch.setattr("oomtune.step.after_optimizer_step", lambda *a: None)
    fixed, fixed_check = _probe_and_check(tmp_path, "fixed-rank")
    assert fixed_check["new_peak_bytes"] == fixed["peak_bytes"] and fixed["plan"] == probed["plan"]
    adapters = sum(p.numel() * 4 for n, p in load_model_file(MODEL).build().named_parameters() if "lora_" in n)
    print(f"peak {probed['peak_bytes']:,} B, {fixed['peak_bytes']:,} B without the allocator; "
          f"adapter weights {adapters:,} B")
    assert probed["peak_bytes"] - fixed["peak_bytes"] >= 3 * adapters


def test_a_run_shorter_than_adaloras_total_step_is_warned(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": str(MODEL), "plan": {"micro_batch_size": 2, "context_length": 16}}))
    r = run_cli("train", "--config", cfg, "--steps", "3", "--warmup-steps", "1", "--device", "cpu", "--run-dir",
                tmp_path / "run")
    assert r.exit_code == 0, r.output
    assert ("warning: AdaLoRA's total_step is 10, and this run trains 3 steps: the run ends before the ranks reach "
            "target_r (set total_step to the run's --steps)") in " ".join(r.output.split())
