"""What this host's CPU cannot compute under CPU autocast (memory/host_kernels.py): an nn.LSTM in bf16 or fp16 on
a CPU without AVX-512. devices: cpu and fake, with and without a card."""

from __future__ import annotations

import pytest
import torch

from oomtune.memory import host_kernels
from oomtune.memory.cards import find_gpu
from oomtune.memory.devices import CpuDevice, FakeDevice
from oomtune.memory.margin import Margin
from oomtune.model_file import load_model_file
from oomtune.search.options import resolve_targets
from oomtune.search.probe import probe

LSTM_MODEL = '''
import torch
from torch import nn

class LSTMLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.lstm = nn.LSTM(16, 24, batch_first=True)
        self.head = nn.Linear(24, 50)

    def forward(self, x):
        h, _ = self.lstm(self.emb(x))
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), x.flatten())

def build_model():
    return LSTMLM()

def make_batch(batch_size, context_length, device):
    return torch.randint(0, 50, (batch_size, context_length), device=device)
'''
CANNOT = "could not create a primitive descriptor for the LSTM forward propagation primitive"


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_the_host_check_says_what_running_an_lstm_under_autocast_does(precision, dtype):
    """The answer is this host's: it is None exactly where a (larger) LSTM's forward and backward run."""
    lstm = torch.nn.LSTM(8, 8, num_layers=2, batch_first=True)
    try:
        with torch.autocast("cpu", dtype=dtype):
            out, _ = lstm(torch.randn(3, 5, 8))
        out.float().sum().backward()
        raised = None
    except RuntimeError as e:
        raised = str(e)
    reason = host_kernels.lstm_autocast_fails(precision)
    assert (reason is None) == (raised is None)
    if reason is not None:
        assert raised.startswith(reason)
    assert host_kernels.lstm_autocast_fails("fp32") is None


def _rungs(result) -> list[str]:
    return [r.rung.name for r in result.ladder.rungs]


@pytest.mark.parametrize("device", ["cpu", "fake"])
def test_an_lstm_model_on_a_host_that_cannot_autocast_it_gets_no_amp_rung_and_a_note(write_model, monkeypatch,
                                                                                     device):
    """On such a host (here made one, whatever this CPU can do) the first amp trial stopped the probe with
    oneDNN's error blamed on the model file. Now the ladder climbs without amp, and says why and what to do."""
    monkeypatch.setattr(host_kernels, "lstm_autocast_fails", lambda precision: CANNOT)
    mf = load_model_file(write_model(LSTM_MODEL))
    targets = resolve_targets(mf, 16, 8, None)
    dev = CpuDevice("1MiB") if device == "cpu" else FakeDevice("1MiB", margin=Margin())
    result = probe(mf, dev, targets, prior=False)
    notes = " ".join(result.notes)
    assert "amp" not in _rungs(result) and _rungs(result)[0] == "fp32"
    assert result.config.plan.precision == "fp32"
    assert f"model.py has an nn.LSTM, which this CPU cannot run under bf16 autocast (oneDNN: {CANNOT}" in notes
    assert "add --gpu NAME" in notes


def test_an_lstm_model_keeps_its_amp_rung_with_a_card_or_where_the_host_runs_it(write_model, monkeypatch):
    """With a card, CUDA autocast's rules run the LSTM on any host (checked here by running it); without one the
    amp rung is there where this host autocasts an LSTM, and the probe's bf16 trials run."""
    mf = load_model_file(write_model(LSTM_MODEL))
    targets = resolve_targets(mf, 16, 8, None)
    carded = probe(mf, CpuDevice("600MiB", card=find_gpu("a100-80")), targets, amp="bf16",
                   objective="throughput", prior=False)  # (throughput: every rung is searched)
    assert "amp" in _rungs(carded) and "nn.LSTM" not in " ".join(carded.notes)
    if host_kernels.lstm_autocast_fails("bf16") is not None:  # this CPU cannot: the previous test's case
        plain = probe(mf, CpuDevice("64MiB"), targets, amp="bf16", objective="throughput", prior=False)
        assert "amp" not in _rungs(plain) and "cannot run under bf16 autocast" in " ".join(plain.notes)
        return
    plain = probe(mf, CpuDevice("64MiB"), targets, amp="bf16", objective="throughput", prior=False)
    assert "amp" in _rungs(plain)


def test_onednns_lstm_error_under_cpu_autocast_gets_a_hint():
    """check and train run the plan they are given: an autocast plan's LSTM error there says what to do."""
    error = RuntimeError(CANNOT + ". Run workload with environment variable ONEDNN_VERBOSE=all")
    assert host_kernels.lstm_hint(error) == ""  # (not under CPU autocast: some other failure of oneDNN's)
    with torch.autocast("cpu", dtype=torch.float16):
        assert host_kernels.lstm_hint(error) == (
            " (this CPU cannot run an nn.LSTM under fp16 autocast, which needs AVX-512: on the cpu and fake devices "
            "give it an fp32 plan, or --gpu NAME to account as that card would)")
        assert host_kernels.lstm_hint(RuntimeError("shape mismatch")) == ""


def test_checking_an_autocast_lstm_plan_on_a_host_that_cannot_run_it_is_one_line_with_the_hint(write_model, tmp_path):
    from ..conftest import run_cli

    if host_kernels.lstm_autocast_fails("bf16") is None:
        pytest.skip("this CPU runs an LSTM under bf16 autocast: the plan checks")
    config = tmp_path / "lstm.yaml"
    config.write_text(f"model: {write_model(LSTM_MODEL)}\nplan:\n  micro_batch_size: 4\n  context_length: 8\n"
                      "  precision: bf16\n")
    r = run_cli("check", "--config", str(config), "--device", "cpu", "--budget", "64MiB")
    assert r.exit_code == 2, r.output
    assert "this CPU cannot run an nn.LSTM under bf16 autocast" in r.stderr.strip().splitlines()[-1]


EXPERTS = '''
import torch
from torch import nn

class Experts(nn.Module):
    """Top-2 routing: each expert's output, weighted by the softmax, added into an fp32 buffer with index_add_."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 4)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        w, idx = self.gate(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            out.index_add_(0, tok, expert(x[tok]) * w[tok, slot, None])
        return out.square().mean()

def build_model():
    torch.manual_seed(0)
    return Experts()

def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, 8, device=device)

DEFAULTS = {"batch": 4, "context": 1}
'''


def test_a_dtype_clash_under_cpu_autocast_gets_a_hint(write_model, tmp_path):
    """device: cpu. CPU autocast runs softmax in bf16 (CUDA's in fp32): the experts' bf16 output meets the fp32
    buffer in index_add_. The probe stops at its amp rung with one line, which says so and what to do."""
    from ..conftest import run_cli

    assert host_kernels.dtype_clash_hint(RuntimeError("self (Float) and source (BFloat16) must have the same "
                                                      "scalar type")) == ""  # not under autocast
    r = run_cli("probe", write_model(EXPERTS), "--device", "cpu", "--budget", "200KiB", "--batch", "4096",
                "--levers", "amp", "--amp", "bf16", "--out", tmp_path / "best.yaml")
    assert r.exit_code == 2, r.output
    line = r.stderr.strip().splitlines()[-1]
    assert "index_add_(): self (Float) and source (BFloat16) must have the same scalar type" in line
    assert ("(under CPU bf16 autocast, which keeps fewer ops in fp32 than CUDA's, softmax among them: --gpu NAME "
            "accounts by that card's CUDA rules; without it, an fp32 plan: leave amp out of --levers) (in the trial "
            "of micro-batch ") in line and line.endswith(", context 1, bf16)")
