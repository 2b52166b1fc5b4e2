"""`oomtune train` with each lever past accumulation, on the cpu device (real compute, simulated memory): 30 steps,
the loss falls, and a resume from the half-way checkpoint gives the uninterrupted run's losses - exactly, except
under 8-bit state, whose requantized moments match within their quantization noise."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from oomtune.train.checkpoint import load_checkpoint
from oomtune.train.trainer import train

from ..conftest import metrics

STEPS, HALF = 30, 15

# a frozen Linear (the NF4 lever's target; 128 x 128 is whole NF4 blocks) between trained blocks
MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(128), nn.Linear(128, 128)) for _ in range(2))
        self.base = nn.Linear(128, 128, bias=False)
        self.base.weight.requires_grad_(False)
        self.out = nn.Linear(128, 4)

    def forward(self, x, y):
        for b in self.blocks:
            x = x + torch.relu(b(x))
        x = x + self.base(x)
        return F.cross_entropy(self.out(x).mean(1), y)

def build_model():
    return Net()

def make_batch(batch_size, context_length, device):
    x = torch.randn(batch_size, context_length, 128, device=device)
    return x, x[..., :4].sum(1).argmax(-1)
'''

LEVERS = {
    "bf16-true": {"precision": "bf16-true"},
    "8bit": {"optimizer_8bit": True},
    "bf16-true+8bit": {"precision": "bf16-true", "optimizer_8bit": True},  # fp32 moments beside bf16 weights
    "nf4": {"nf4_frozen_weights": True},
    "offload": {"offload_optimizer": True, "grad_accum_steps": 2, "micro_batch_size": 4},
    "offload-activations": {"offload_activations": True, "activation_checkpointing": True},
    "bnb-nf4-dq": {},  # not a plan key: the model file's BitsAndBytesConfig (BNB below)
}
BNB = '''
from transformers import BitsAndBytesConfig
bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True)
'''


def run(tmp: Path, plan: dict, resume: bool = False) -> Path:
    cfg = tmp / "c.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": "model.py",
        "plan": {"micro_batch_size": 8, "context_length": 8, **plan},
        "train": {"steps": STEPS, "lr": 0.01, "min_lr": 0.001, "warmup_steps": 3, "eval_interval": HALF,
                  "eval_steps": 2, "log_every_n_steps": 1, "checkpoint_interval": HALF, "run_dir": "run"},
    }))
    cwd = Path.cwd()
    os.chdir(tmp)
    try:
        train(cfg, device="cpu", resume=resume)
    finally:
        os.chdir(cwd)
    return tmp / "run"


@pytest.mark.parametrize("lever", LEVERS)
def test_each_lever_trains_and_resumes(lever, tmp_path):
    if lever == "nf4" and importlib.util.find_spec("torchao") is None:
        pytest.skip("needs torchao")
    if lever == "bnb-nf4-dq" and importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("needs bitsandbytes")
    torch.set_num_threads(1)
    (tmp_path / "model.py").write_text(MODEL + (BNB if lever == "bnb-nf4-dq" else ""))
    whole = run(tmp_path, LEVERS[lever])
    ref = [r["loss"] for r in metrics(whole)]
    assert len(ref) == STEPS
    first, last = sum(ref[:5]) / 5, sum(ref[-5:]) / 5
    print(f"{lever}: loss {first:.3f} -> {last:.3f}")
    assert last < 0.9 * first  # (ln 4 = 1.39 is the uniform guess)

    ckpt = load_checkpoint(whole / f"ckpt-{HALF:08d}.pt")
    if lever in ("nf4", "bnb-nf4-dq"):  # rebuilt from the model file, not saved
        assert "base.weight" not in ckpt["model"] and "out.weight" in ckpt["model"]
    resumed_dir = tmp_path / "again"
    resumed_dir.mkdir()
    shutil.copy(tmp_path / "model.py", resumed_dir)  # (the same config reads the same BitsAndBytesConfig)
    shutil.copytree(whole, resumed_dir / "run")
    (resumed_dir / "run" / f"ckpt-{STEPS:08d}.pt").unlink()
    again = [r["loss"] for r in metrics(run(resumed_dir, LEVERS[lever], resume=True))]
    assert len(again) == STEPS
    if "8bit" in lever:
        assert again[HALF:] == pytest.approx(ref[HALF:], rel=0.05)
    else:
        assert again[HALF:] == ref[HALF:]


def test_an_out_of_memory_fallback_keeps_every_lever_and_the_loss_falls(tmp_path):
    """A budget between the peaks of micro-batch 8 and 4 (with 8-bit state and both offloads): the first step runs
    out, the trainer halves the micro-batch (x2 accumulation: the same global batch), writes the plan back with
    its levers, and trains on."""
    from oomtune.config.loading import load_config
    from oomtune.config.schema import Plan
    from oomtune.memory.devices import CpuDevice
    from oomtune.model_file import load_model_file
    from oomtune.search.trial import run_trial

    torch.set_num_threads(1)
    (tmp_path / "model.py").write_text(MODEL)
    keys = {"optimizer_8bit": True, "offload_optimizer": True, "offload_activations": True}
    mf = load_model_file(tmp_path / "model.py")
    big, small = (run_trial(mf, Plan(b, 8, grad_accum_steps=8 // b, **keys), CpuDevice("1GiB")).peak_bytes
                  for b in (8, 4))
    assert small < big
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": "model.py", "plan": {"micro_batch_size": 8, "context_length": 8, **keys},
                                   "train": {"steps": STEPS, "lr": 0.01, "min_lr": 0.001, "warmup_steps": 3,
                                             "eval_interval": STEPS, "eval_steps": 2, "log_every_n_steps": 1,
                                             "checkpoint_interval": STEPS, "run_dir": "run"}}))
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        result = train(cfg, device="cpu", budget=str((big + small) // 2))
    finally:
        os.chdir(cwd)
    assert [f.step for f in result.fallbacks] == [1]
    plan = load_config(cfg).plan
    assert (plan.micro_batch_size, plan.grad_accum_steps, plan.global_batch_size) == (4, 2, 8)
    assert plan.optimizer_8bit and plan.offload_optimizer and plan.offload_activations
    losses = [r["loss"] for r in metrics(tmp_path / "run")]
    assert len(losses) == STEPS and sum(losses[-5:]) < 0.9 * sum(losses[:5])
