"""The model files and configs the trainer's tests share (written to tmp_path by each test)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import yaml

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


RESUME_PLAN = {"micro_batch_size": 4, "context_length": 16, "grad_accum_steps": 2}
RESUME_STEPS = 60


def resume_config(tmp: Path, checkpoint_interval: int) -> Path:
    model = tmp / "resume_model.py"
    model.write_text(textwrap.dedent(RESUME_MODEL))
    return write_config(tmp / "resume.yaml", model, RESUME_PLAN,
                        {"steps": RESUME_STEPS, "lr": 0.003, "warmup_steps": 10, "eval_interval": 25, "eval_steps": 2,
                         "log_every_n_steps": 1, "checkpoint_interval": checkpoint_interval, "seed": 7})
