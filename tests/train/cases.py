"""What tests/train/test_failures.py and tests/train/test_divergence.py share: a tiny model file whose chosen
draws go wrong (marker files next to it), its config, and readers for the run dir. `cpu` device throughout."""


from __future__ import annotations

from pathlib import Path

import yaml

from oomtune.train.checkpoint import list_checkpoints

from ..conftest import TINY_MODEL, metrics, run_cli

# Dropout and seeded data: a resume is exact. Marker files next to the model make chosen draws go wrong:
# `nan-at` (a draw whose inputs hold a NaN), `fail-at` (a draw that raises), `short-at` / `long-at` (a draw of
# one example fewer / 4 positions longer than asked).
MODEL = (TINY_MODEL
         .replace("        self.out = nn.Linear(16, 4)\n",
                  "        self.out = nn.Linear(16, 4)\n        self.drop = nn.Dropout(0.1)\n")
         .replace("x = torch.relu(b(x))", "x = self.drop(torch.relu(b(x)))")
         + '''
import os
import signal
from pathlib import Path

DRAWS = [0]
HERE = Path(__file__).parent

def _at(name):
    p = HERE / name
    return int(p.read_text()) if p.exists() else None

def train_batches(batch_size, context_length, device):
    while True:
        DRAWS[0] += 1
        if DRAWS[0] == _at("fail-at"):
            raise ValueError("the data server went away")
        if DRAWS[0] == _at("ctrl-c-at"):
            os.kill(os.getpid(), signal.SIGINT)
        if DRAWS[0] == _at("ctrl-c-twice-at"):  # the second one swallowed, as inside a finalizer
            try:
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)
            except KeyboardInterrupt:
                pass
            raise KeyError("state the interrupted finalizer left half-done")
        longer = 4 * (DRAWS[0] == _at("long-at"))
        x = torch.randn(batch_size - (DRAWS[0] == _at("short-at")), context_length + longer, 16, device=device)
        if DRAWS[0] == _at("nan-at"):
            x[0, 0, 0] = float("nan")
        yield x, (x.sum((1, 2)) > 0).long()
''')
assert "self.drop(" in MODEL and "self.drop = " in MODEL

PLAN = {"micro_batch_size": 2, "context_length": 8, "grad_accum_steps": 2}  # 2 draws a step


def make_case(tmp_path: Path, write_model) -> Path:
    """The model file and its config (best.yaml: 10 steps, a checkpoint every 3, run dir `run`) in tmp_path."""
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


def losses(run_dir: Path) -> list[float]:
    return [x for r in metrics(run_dir) for x in (r["step"], r["loss"], r["lr"])]


def steps_saved(run_dir: Path) -> list[int]:
    return [step for step, _ in list_checkpoints(run_dir)]
