"""Several ranks, continued: the probe on two ranks picks the fsdp rung where one rank cannot hold the model (the
estimate predicts it), where torch cannot run FSDP off CUDA the ladder says so, and bad input or a rank that dies or
stops answering ends the run with one clear line."""

from __future__ import annotations

import json
import socket
import textwrap

import pytest
import torch

from oomtune.config.loading import load_config

from ..conftest import metrics, run_cli
from .helpers import ENV, PLAN, error_lines, needs_fsdp, oomtune, write_config

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
    one = run_cli("estimate", model, *args, "--margin", "0", "--sharding", "none", "--out", tmp_path / "one.yaml",
                  "--levers", "amp,checkpointing,accumulation")
    assert one.exit_code == 2  # one process cannot fit it on the classic ladder: the weights alone are over


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
    assert r.exit_code == 2, r.output  # replicated, the weights alone are over: without fsdp nothing fits
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

if os.environ.get("RANK") == "1":
    time.sleep(float(os.environ["JOIN_LATE"]))  # joins the other rank later than --dist-timeout

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
    sleep = 6.0
    # rank 1 also starts 3 s late: the join waits longer than --dist-timeout (a slow start is not a dead rank)
    env = {**ENV, "HOW": "die" if how == "die" else str(sleep), "JOIN_LATE": "3"}
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
