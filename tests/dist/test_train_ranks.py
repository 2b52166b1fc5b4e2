"""Several ranks: `oomtune train / probe --nproc-per-node 2` under torchrun, on the CPU with gloo and the simulated
`cpu` device (each rank its own budget), DDP and FSDP2 on the tiny GPT.

What is shown: two ranks train the same run one process does (same losses, global batch exact); FSDP holds about
half the weights + gradients + optimizer state per rank; one rank running out of memory halves the micro-batch on
both; a budget too small to replicate the model makes the probe pick the fsdp rung (and the fake-device estimate
predicts the same peak); a 2-rank checkpoint resumes on 1 and on 2 ranks (and a 1-process one on 2), continuing
the same run; bad input and a rank that dies or stops answering end the run with one clear line.

Each launch costs a few seconds on a 2-core box (two fresh Python processes importing torch): the expensive runs
are module fixtures shared by the tests, the models tiny and the runs short."""

from __future__ import annotations

import os
import shutil
import statistics
from pathlib import Path

import pytest
import torch

from oomtune.config.loading import load_config
from oomtune.config.schema import Config, Plan
from oomtune.config.writing import dump_config
from oomtune.errors import ConfigError
from oomtune.memory.tracker import MemoryTracker
from oomtune.train.checkpoint import list_checkpoints
from oomtune.train.recovery import smaller_plan

from ..conftest import events, metrics
from .helpers import HALF, NO_FSDP, PLAN, STEPS, losses, oomtune, write_config


def train_ranks(tmp: Path, sharding: str) -> Path:
    cfg = write_config(tmp / f"{sharding}.yaml", {**PLAN, "world_size": 2, "sharding": sharding})
    proc = oomtune("train", "--config", cfg, "--device", "cpu", "--nproc-per-node", "2", "--run-dir", "run",
                   cwd=tmp)
    assert proc.returncode == 0, proc.stderr
    print(f"{sharding} on 2 ranks: {proc.seconds:.1f}s")
    return tmp / "run"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """The reference: one process, the same global batch of 8 as 4 x 2 accumulation."""
    from oomtune.train.trainer import train

    tmp = tmp_path_factory.mktemp("one")
    cfg = write_config(tmp / "one.yaml", {**PLAN, "grad_accum_steps": 2})
    cwd = Path.cwd()
    os.chdir(tmp)
    try:
        train(cfg, device="cpu")
    finally:
        os.chdir(cwd)
    return tmp / "run"


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> Path:
    return train_ranks(tmp_path_factory.mktemp("ddp"), "ddp")


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory) -> Path:
    if NO_FSDP is not None:
        pytest.skip(NO_FSDP)
    return train_ranks(tmp_path_factory.mktemp("fsdp"), "fsdp")


# -- the plan ------------------------------------------------------------------------------------------------

def test_the_global_batch_counts_the_ranks_and_old_configs_load_unchanged(tmp_path):
    plan = Plan(4, 32, grad_accum_steps=2, world_size=2, sharding="fsdp")
    assert plan.global_batch_size == 16
    with pytest.raises(ConfigError, match="micro_batch_size x grad_accum_steps x world_size = 4 x 2 x 2 = 16"):
        Plan(4, 32, grad_accum_steps=2, world_size=2, sharding="ddp", global_batch_size=8)
    with pytest.raises(ConfigError, match="ranks need ddp"):
        Plan(4, 32, world_size=2)
    with pytest.raises(ConfigError, match="plan.sharding must be one of none, ddp, fsdp"):
        Plan(4, 32, sharding="zero3")
    # the same global batch on other numbers of ranks; a micro-batch that cannot share out evenly is cut
    assert plan.for_world_size(1) == Plan(4, 32, grad_accum_steps=4, world_size=1, sharding="fsdp")
    assert plan.for_world_size(4) == Plan(4, 32, grad_accum_steps=1, world_size=4, sharding="fsdp")
    assert Plan(8, 32).for_world_size(2) == Plan(4, 32, world_size=2, sharding="ddp")
    # a ddp plan on one process drops ddp (its buckets only cost memory: a 2-rank plan on 1 went past the limit)
    assert Plan(4, 32, world_size=2, sharding="ddp").for_world_size(1) == Plan(4, 32, grad_accum_steps=2)
    assert Plan(3, 32).for_world_size(2) is None
    assert smaller_plan(plan) == Plan(2, 32, grad_accum_steps=4, world_size=2, sharding="fsdp")

    old = tmp_path / "old.yaml"  # a config from before multi-GPU: no world_size, no sharding
    old.write_text("model: m.py\nplan:\n  micro_batch_size: 8\n  context_length: 64\n  grad_accum_steps: 2\n"
                   "  global_batch_size: 16\n")
    assert load_config(old).plan == Plan(8, 64, grad_accum_steps=2)
    text = dump_config(Config("m.py", plan))
    assert "world_size: 2  # ranks" in text and "sharding: fsdp  # none | ddp" in text
    assert "global_batch_size: 16  # micro_batch_size x grad_accum_steps x world_size" in text


def test_the_tracker_follows_storages_resized_in_place_as_fsdp_does():
    """FSDP frees and re-allocates a gathered parameter with untyped_storage().resize_(), which never reaches the
    dispatcher: the tracker must see both, and refuse to grow past its budget like the allocator."""
    tr = MemoryTracker(budget_bytes=8192)
    with tr:
        t = torch.zeros(1024)  # 4 KiB
        t.untyped_storage().resize_(0)
        assert tr.live_bytes == 0
        t.untyped_storage().resize_(4096)
        assert tr.live_bytes == 4096
        with pytest.raises(torch.cuda.OutOfMemoryError, match="Tried to allocate 8.00 KiB"):
            t.untyped_storage().resize_(12288)
        assert t.untyped_storage().nbytes() == 4096  # refused before resizing
    assert torch.UntypedStorage.resize_ is not type(tr)  # restored outside the tracker
    t.untyped_storage().resize_(0)  # untracked now
    assert tr.live_bytes == 4096


# -- training on two ranks -----------------------------------------------------------------------------------

def test_ddp_and_fsdp_on_two_ranks_train_the_run_one_process_trains(one_process, ddp, fsdp):
    ref = metrics(one_process)
    for run in (ddp, fsdp):
        rows = metrics(run)
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        assert all((r["micro_batch_size"], r["grad_accum_steps"]) == (4, 1) for r in rows)  # x 2 ranks = 8
        first, last = rows[0]["loss"], rows[-1]["loss"]
        evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
        ref_evals = [r["eval_loss"] for r in ref if "eval_loss" in r]
        print(f"{run.parent.name}: loss {first:.3f} -> {last:.3f}, eval {evals}; one process "
              f"{ref[0]['loss']:.3f} -> {ref[-1]['loss']:.3f}, eval {ref_evals}")
        assert last < 0.75 * first and evals[-1] < evals[0]  # it learns
        # the same global batches, averaged over the ranks: the one-process run, step for step
        assert losses(rows) == pytest.approx(losses(ref), rel=1e-4)
        assert evals == pytest.approx([r["eval_loss"] for r in ref if "eval_loss" in r], rel=1e-4)
    assert [p.name for _, p in list_checkpoints(fsdp)] == [f"ckpt-{HALF:08d}", f"ckpt-{STEPS:08d}"]


def test_fsdp_holds_about_half_the_weights_gradients_and_optimizer_state_per_rank(one_process, ddp, fsdp):
    single = metrics(one_process)[-1]["state_bytes"]
    replicated = metrics(ddp)[-1]["state_bytes"]
    sharded = metrics(fsdp)[-1]["state_bytes"]
    peaks = {name: max(r["peak_bytes"] for r in metrics(run)) for name, run in
             (("one process", one_process), ("ddp", ddp), ("fsdp", fsdp))}
    print(f"weights + gradients + optimizer state per rank: one process {single}, ddp {replicated}, fsdp {sharded} "
          f"(fsdp / one process = {sharded / single:.3f}); peaks {peaks}")
    assert replicated == single  # DDP replicates it
    assert 0.4 < sharded / single < 0.6
    assert peaks["fsdp"] < peaks["ddp"]


def test_only_rank_1_running_out_of_memory_halves_the_micro_batch_on_both(ddp, tmp_path):
    """Rank 1 gets a budget 512 KiB under the DDP run's peak at micro-batch 4 (micro-batch 2 needs ~2.5 MiB less;
    rank 0 keeps the machine's RAM): it runs out at the first step that reaches the peak, both ranks fall back
    to 2 x 2, the run finishes with every step, the global batch unchanged, and the very same losses (the failed
    step was retried on the same batches, by both ranks)."""
    peak = statistics.median(r["peak_bytes"] for r in metrics(ddp)[1:])  # after step 1, which has no AdamW state
    budget = int(peak) - (512 << 10)
    cfg = write_config(tmp_path / "c.yaml", {**PLAN, "world_size": 2, "sharding": "ddp"})
    proc = oomtune("train", "--config", cfg, "--device", "cpu", "--nproc-per-node", "2", "--rank-budget",
                   f"1={budget}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    run = tmp_path / "run"
    rows = metrics(run)
    (fallback,) = events(run, "oom_fallback")
    print(f"rank 1 budget {budget}: fell back at step {fallback['step']}: {fallback['message'][:90]}")
    assert "out of memory on rank 1 of 2" in fallback["message"]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # the step count unchanged
    step = fallback["step"]
    assert [(r["micro_batch_size"], r["grad_accum_steps"]) for r in rows] == \
        [(4, 1)] * (step - 1) + [(2, 2)] * (STEPS - step + 1)  # x 2 ranks: a global batch of 8 throughout
    assert losses(rows) == pytest.approx(losses(metrics(ddp)), rel=1e-4)
    plan = load_config(cfg).plan  # the plan that works, written back
    assert (plan.micro_batch_size, plan.grad_accum_steps, plan.world_size, plan.global_batch_size) == (2, 2, 2, 8)
    assert "out of memory" in proc.stderr and "falling back" in proc.stderr


def test_fsdp_running_out_of_memory_on_rank_1_restarts_every_rank_from_the_last_checkpoint(fsdp, tmp_path):
    """Under FSDP a rank that runs out alone leaves the others inside an all-gather, and a step left half way
    cannot be retried in place: the ranks stop, the halved plan is written to the config, and the launcher
    relaunches them from the last checkpoint (every step here). The run ends with every step and the losses of
    the run that never ran out (the resume is exact)."""
    # FSDP's peak wobbles by one gathered unit (~200 KiB: when an async all-gather's buffer is let go); micro-batch
    # 2 needs ~2.5 MiB less than 4: a budget 1 MiB under the usual peak at 4 separates them
    budget = int(statistics.median(r["peak_bytes"] for r in metrics(fsdp)[1:])) - (1 << 20)
    cfg = write_config(tmp_path / "c.yaml", {**PLAN, "world_size": 2, "sharding": "fsdp"}, {"checkpoint_interval": 1})
    # rank 1 asks the store for 8/2 s whether rank 0 ran out too, well before rank 0's all-gather times out (8 s)
    proc = oomtune("train", "--config", cfg, "--device", "cpu", "--nproc-per-node", "2", "--rank-budget",
                   f"1={budget}", "--dist-timeout", "8", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    run = tmp_path / "run"
    (relaunch,) = events(run, "oom_relaunch")
    print(f"fsdp, rank 1 in {budget}: stopped at step {relaunch['step']} ({relaunch['message'][:80]}), relaunched "
          f"in {proc.seconds:.1f}s in all")
    assert "rank 1 ran out of memory inside an FSDP step and the other ranks did not" in relaunch["message"]
    step = relaunch["step"]
    assert f"relaunching every rank with the halved plan, from run/ckpt-{step - 1:08d}" in proc.stderr
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [(r["micro_batch_size"], r["grad_accum_steps"]) for r in rows] == \
        [(4, 1)] * (step - 1) + [(2, 2)] * (STEPS - step + 1)
    assert losses(rows) == pytest.approx(losses(metrics(fsdp)), rel=1e-4)
    assert all(r["peak_bytes"] <= budget for r in rows[step - 1:])
    assert load_config(cfg).plan == Plan(2, 64, grad_accum_steps=2, world_size=2, sharding="fsdp")


# -- resume on another number of ranks -------------------------------------------------------------------------

def test_a_two_rank_fsdp_checkpoint_resumes_on_one_rank(fsdp, tmp_path):
    """From the half-way checkpoint of the 2-rank FSDP run, the remaining steps on one process are those of the
    uninterrupted run (DCP reshards the weights and optimizer state; the data stream is replayed; the global batch
    is kept by accumulation). On two ranks: the FSDP out-of-memory test above relaunches both ranks from a 2-rank
    checkpoint and checks the same, loss for loss."""
    run = tmp_path / "run"
    shutil.copytree(fsdp, run)
    shutil.rmtree(run / f"ckpt-{STEPS:08d}")
    cfg = write_config(tmp_path / "c.yaml", {**PLAN, "world_size": 2, "sharding": "fsdp"})
    proc = oomtune("train", "--config", cfg, "--device", "cpu", "--resume", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows, ref = metrics(run), metrics(fsdp)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert losses(rows[HALF:]) == pytest.approx(losses(ref[HALF:]), rel=1e-4)
    assert "written by 2 rank(s) (fsdp), resuming on 1" in proc.stderr
    assert {(r["micro_batch_size"], r["grad_accum_steps"]) for r in rows[HALF:]} == {(4, 2)}  # same global batch
    print(f"2-rank checkpoint resumed on 1: the remaining losses match, largest relative difference "
          f"{max(abs(a - b) / b for a, b in zip(losses(rows[HALF:]), losses(ref[HALF:]), strict=True)):.2g}")


def test_a_one_process_checkpoint_resumes_on_two_ranks(one_process, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(one_process, run)
    (run / f"ckpt-{STEPS:08d}.pt").unlink()
    cfg = write_config(tmp_path / "c.yaml", {**PLAN, "grad_accum_steps": 2})
    proc = oomtune("train", "--config", cfg, "--device", "cpu", "--resume", "--nproc-per-node", "2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = metrics(run)
    assert {(r["micro_batch_size"], r["grad_accum_steps"]) for r in rows[HALF:]} == {(4, 1)}  # ddp x 2 ranks
    assert losses(rows[HALF:]) == pytest.approx(losses(metrics(one_process)[HALF:]), rel=1e-4)


