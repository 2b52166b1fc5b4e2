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

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml

from oomtune.config.loading import load_config
from oomtune.config.schema import Config, Plan
from oomtune.config.writing import dump_config
from oomtune.dist.wrap import fsdp_unsupported
from oomtune.errors import ConfigError
from oomtune.memory.tracker import MemoryTracker
from oomtune.train.checkpoint import list_checkpoints
from oomtune.train.recovery import smaller_plan

from .conftest import EXAMPLES, events, metrics, run_cli

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"}
STEPS = 20
TRAIN = {"steps": STEPS, "lr": 0.01, "min_lr": 0.001, "warmup_steps": 2, "eval_interval": 10, "eval_steps": 2,
         "log_every_n_steps": 1, "checkpoint_interval": 10, "run_dir": "run"}
PLAN = {"micro_batch_size": 4, "context_length": 64}  # per rank; global batch 8 on two ranks
NO_FSDP = fsdp_unsupported("cpu")  # torch < 2.7: FSDP2 cannot run on the CPU (gloo) at all
needs_fsdp = pytest.mark.skipif(NO_FSDP is not None, reason=str(NO_FSDP))


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
    assert [p.name for _, p in list_checkpoints(fsdp)] == ["ckpt-00000010", "ckpt-00000020"]


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

@pytest.mark.parametrize("ranks", [1, 2])
def test_a_two_rank_fsdp_checkpoint_resumes_on_one_and_on_two_ranks(fsdp, ranks, tmp_path):
    """From the step-10 checkpoint of the 2-rank FSDP run, steps 11-20 on `ranks` ranks are those of the
    uninterrupted run (DCP reshards the weights and optimizer state; the data stream is replayed)."""
    run = tmp_path / "run"
    shutil.copytree(fsdp, run)
    shutil.rmtree(run / "ckpt-00000020")
    cfg = write_config(tmp_path / "c.yaml", {**PLAN, "world_size": 2, "sharding": "fsdp"})
    args = ["--nproc-per-node", "2"] if ranks == 2 else []
    proc = oomtune("train", "--config", cfg, "--device", "cpu", "--resume", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows, ref = metrics(run), metrics(fsdp)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert losses(rows[10:]) == pytest.approx(losses(ref[10:]), rel=1e-4)
    if ranks == 1:
        assert "written by 2 rank(s) (fsdp), resuming on 1" in proc.stderr
        assert {(r["micro_batch_size"], r["grad_accum_steps"]) for r in rows[10:]} == {(4, 2)}  # same global batch
    print(f"2-rank checkpoint resumed on {ranks}: losses 11-20 match, largest relative difference "
          f"{max(abs(a - b) / b for a, b in zip(losses(rows[10:]), losses(ref[10:]), strict=True)):.2g}")


def test_a_one_process_checkpoint_resumes_on_two_ranks(one_process, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(one_process, run)
    (run / "ckpt-00000020.pt").unlink()
    cfg = write_config(tmp_path / "c.yaml", {**PLAN, "grad_accum_steps": 2})
    proc = oomtune("train", "--config", cfg, "--device", "cpu", "--resume", "--nproc-per-node", "2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = metrics(run)
    assert {(r["micro_batch_size"], r["grad_accum_steps"]) for r in rows[10:]} == {(4, 1)}  # ddp x 2 ranks
    assert losses(rows[10:]) == pytest.approx(losses(metrics(one_process)[10:]), rel=1e-4)


# -- the probe on two ranks --------------------------------------------------------------------------------------

WIDE_MODEL = '''
"""Weights-heavy: 1 MiB of fp32 weights in 4 blocks, almost no activations."""
import torch
import torch.nn.functional as F
from torch import nn

W = 256

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(W, W)

    def forward(self, x):
        return x + torch.relu(self.fc(x))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.out = nn.Linear(W, 8)

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.out(x).flatten(0, 1), y.flatten())

def build_model():
    return Net()

def make_batch(batch_size, context_length, device):
    return (torch.randn(batch_size, context_length, W, device=device),
            torch.randint(0, 8, (batch_size, context_length), device=device))
'''


@needs_fsdp
def test_a_budget_too_small_to_replicate_the_model_makes_the_probe_pick_fsdp(tmp_path):
    """Weights + gradients + AdamW state are 4.05 MiB: 4 MiB cannot hold them on one rank, whatever the batch;
    sharded over 2 ranks they fit. The fake-device estimate for 2 ranks predicts the probe's plan and peak."""
    from oomtune.memory.breakdown import static_memory
    from oomtune.model_file import load_model_file

    model = tmp_path / "wide.py"
    model.write_text(textwrap.dedent(WIDE_MODEL))
    static = static_memory(load_model_file(model))
    budget = 4 << 20
    assert static.total_bytes > budget > static.total_bytes // 2
    args = ["--batch", "8", "--context", "4", "--budget", str(budget), "--headroom", "0"]
    proc = oomtune("probe", model, "--device", "cpu", *args, "--nproc-per-node", "2", "--out", "best.yaml",
                   "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    rungs = {r["rung"]: r for r in result["rungs"]}
    trials = [(t["rung"], t["micro_batch_size"], t["result"]) for t in result["trials"]]
    print(f"probe on 2 ranks in {proc.seconds:.1f}s: {trials}")
    assert list(rungs) == ["fp32", "amp", "checkpointing", "fsdp"]
    assert all(rungs[r]["micro_batch_size"] is None for r in ("fp32", "amp", "checkpointing"))  # replicated: none fit
    assert all(t["result"] == "oom" for t in result["trials"] if t["sharding"] == "ddp")
    plan = load_config(tmp_path / "best.yaml").plan
    assert (plan.sharding, plan.world_size, plan.global_batch_size) == ("fsdp", 2, 8)

    est = run_cli("estimate", model, *args, "--margin", "0", "--world-size", "2", "--json", "--out",
                  tmp_path / "est.yaml")
    assert est.exit_code == 0, est.output
    predicted = json.loads(est.stdout)
    print(f"estimate for 2 ranks: {predicted['plan']}, peak {predicted['peak_bytes']} vs probed {result['peak_bytes']}")
    assert predicted["plan"] == result["plan"]
    # on real ranks the peak wobbles by up to one gathered FSDP unit (when gloo's async all-gather lets go of its
    # buffers); the fake world has no threads: it is the peak without the wobble
    mf = load_model_file(model)
    unit = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in mf.blocks(mf.build()))
    assert abs(result["peak_bytes"] - predicted["peak_bytes"]) <= unit
    one = run_cli("estimate", model, *args, "--margin", "0", "--sharding", "none", "--out", tmp_path / "one.yaml")
    assert one.exit_code == 1  # one process cannot fit it: the weights alone are over


def test_where_torch_cannot_run_fsdp_off_cuda_the_ladder_leaves_that_rung_out_and_says_so(tmp_path, monkeypatch):
    """device: fake (2 ranks in one process). torch before 2.7 cannot run FSDP2 on the CPU: the ladder has no fsdp
    rung there (it would fail on its first forward), nothing fitting says why, and asking for fsdp is one line."""
    from oomtune.dist import wrap as parallel

    model = tmp_path / "wide.py"
    model.write_text(textwrap.dedent(WIDE_MODEL))
    args = ["--batch", "8", "--context", "4", "--budget", str(4 << 20), "--headroom", "0", "--margin", "0",
            "--world-size", "2"]
    monkeypatch.setattr(parallel, "_torch_version", lambda: (2, 6))
    assert parallel.fsdp_unsupported("cuda") is None
    why = parallel.fsdp_unsupported("cpu")
    assert why == f"FSDP2 runs off CUDA (on the cpu device) only from torch 2.7; this is torch {torch.__version__}"
    from oomtune.memory.devices import make_device
    from oomtune.search.probe import ladder_rungs

    fake = make_device("fake", "1GiB")
    assert [r.name for r in ladder_rungs(fake, "auto", True, world_size=2)] == ["fp32", "amp", "checkpointing"]
    r = run_cli("estimate", model, *args, "--json", "--out", tmp_path / "e.yaml")
    assert r.exit_code == 1, r.output  # replicated, the weights alone are over: without fsdp nothing fits
    assert json.loads(r.stdout)["why_nothing_fits"].endswith(f"No fsdp rung was tried: {why}.")
    r = run_cli("estimate", model, *args, "--sharding", "fsdp", "--out", tmp_path / "f.yaml")
    assert r.exit_code == 2 and r.stderr.strip().splitlines()[-1] == f"error: --sharding fsdp: {why}", r.output
    assert not (tmp_path / "f.yaml").exists()

    monkeypatch.setattr(parallel, "_torch_version", lambda: (2, 7))
    assert parallel.fsdp_unsupported("cpu") is None
    assert [r.name for r in ladder_rungs(fake, "auto", True, world_size=2)][-1] == "fsdp"


# -- bad input and failing ranks ---------------------------------------------------------------------------------

def test_zero_ranks_and_a_port_in_use_are_bad_input(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", {**PLAN, "world_size": 2, "sharding": "ddp"})
    r = run_cli("train", "--config", cfg, "--device", "cpu", "--nproc-per-node", "0")
    assert r.exit_code == 2 and "--nproc-per-node must be at least 1, got 0" in r.stderr
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = run_cli("train", "--config", cfg, "--device", "cpu", "--nproc-per-node", "2", "--master-port", port)
    assert r.exit_code == 2, r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.strip()]
    assert line.startswith("error:") and f"--master-port {port} is in use" in line
    assert not (tmp_path / "run").exists()


DYING_MODEL = '''
import os, signal, time
import torch
import torch.nn.functional as F
from torch import nn

def build_model():
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))

def loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)

def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, 8, device=device), torch.randint(0, 4, (batch_size,), device=device)

def train_batches(batch_size, context_length, device):
    n = 0
    while True:
        n += 1
        if n == 6 and os.environ["RANK"] == "1":  # rank 1, in step 3
            if os.environ["HOW"] == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(float(os.environ["HOW"]))  # stops answering for that long
        yield make_batch(batch_size, context_length, device)
'''


@pytest.mark.parametrize("how", ["die", "hang"])
def test_a_rank_that_dies_or_stops_answering_stops_the_run_with_one_clear_line(how, tmp_path):
    model = tmp_path / "dying.py"
    model.write_text(textwrap.dedent(DYING_MODEL))
    cfg = write_config(tmp_path / "c.yaml", {"micro_batch_size": 2, "context_length": 1, "world_size": 2,
                                             "sharding": "ddp"}, {"checkpoint_interval": 100}, model=model)
    sleep = 12.0
    env = {**ENV, "HOW": "die" if how == "die" else str(sleep)}
    proc = oomtune("train", "--config", cfg, "--device", "cpu", "--nproc-per-node", "2", "--dist-timeout", "2",
                   cwd=tmp_path, env=env, timeout=120)
    print(f"{how}: exit {proc.returncode} after {proc.seconds:.1f}s; {error_lines(proc)}")
    assert proc.returncode == 1
    last = error_lines(proc)[-1]  # the launcher's summary names the rank that failed first
    if how == "die":
        assert "rank 1" in last and "was killed by SIGKILL" in last
        assert any("[rank 0] a collective with the other ranks failed" in x for x in error_lines(proc))
    else:
        assert "rank 0 stopped first: a collective with the other ranks broke or timed out" in last
        assert any("[rank 0]" in x and "Timed out" in x for x in error_lines(proc))
        assert proc.seconds < sleep + 45  # it did not wait for the silent rank beyond its own sleep
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2]
