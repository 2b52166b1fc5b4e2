"""What the tests on several ranks share: the launch helper, the configs, the tiny GPT's plan."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from oomtune.dist.wrap import fsdp_unsupported

from ..conftest import EXAMPLES

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"}
STEPS, HALF = 8, 4  # short runs (each launch is three fresh processes importing torch); a checkpoint half way
TRAIN = {"steps": STEPS, "lr": 0.01, "min_lr": 0.001, "warmup_steps": 2, "eval_interval": HALF, "eval_steps": 2,
         "log_every_n_steps": 1, "checkpoint_interval": HALF, "run_dir": "run"}
PLAN = {"micro_batch_size": 4, "context_length": 64}  # per rank; global batch 8 on two ranks
NO_FSDP = fsdp_unsupported("cpu")  # torch < 2.7: FSDP2 cannot run on the CPU (gloo) at all
needs_fsdp = pytest.mark.skipif(NO_FSDP is not None, reason=str(NO_FSDP))


def oomtune(*args, cwd: Path, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """The installed command in a fresh process, as a user (and torchrun) runs it."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "oomtune", *map(str, args)], cwd=cwd, env=env or ENV,
                          capture_output=True, text=True, timeout=timeout)
    proc.seconds = time.monotonic() - start
    return proc


def write_config(path: Path, plan: dict, train: dict | None = None, model: Path = EXAMPLES / "tiny_gpt.py") -> Path:
    path.write_text(yaml.safe_dump({"model": str(model), "plan": plan, "train": {**TRAIN, **(train or {})}},
                                   sort_keys=False))
    return path


def losses(rows: list[dict]) -> list[float]:
    return [r["loss"] for r in rows]


def error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


