"""The optimizer phase on fake tensors made from the first of its kind (memory/made_optim.py): gradient clipping on
every step, torch's own optimizer step where it is a first one or a trial's last. A trial's figures, its trace
(every storage's birth, size and death, in order) and its breakdown equal those with every call computed: AdamW
(fused, as on a GPU) in fp32 and under fp16 with its GradScaler, SGD with momentum, each in a trial of one step (the
state made), of two (the second's step made too, on the made state) and of three (the second computed on it: the
step count it reads was made known). A model file's own optimizer class and real tensors are computed.
Devices: fake (the estimate's never-out twin with a card's rules, which traces) and cpu."""

from __future__ import annotations

import json

import pytest
import torch

from oomtune.config.schema import Plan
from oomtune.dist.group import LOCAL
from oomtune.memory import made_calls, made_optim
from oomtune.memory.breakdown import recorded_trial
from oomtune.memory.cards import find_gpu
from oomtune.memory.devices import CpuDevice, FakeDevice
from oomtune.model_file import load_model_file
from oomtune.search.trial import run_trial

from ..conftest import EXAMPLES, run_cli
from ..levers.test_fake_scratch import _counted as counted

SGD = """
def optimizer(params, lr):
    return torch.optim.SGD(params, lr=lr, momentum=0.9)
"""
OWN = """
class Own(torch.optim.SGD):
    pass

def optimizer(params, lr):
    return Own(params, lr=lr, momentum=0.9)
"""


def _model(tmp_path, extra: str = ""):
    path = tmp_path / "gpt.py"
    path.write_text((EXAMPLES / "tiny_gpt.py").read_text() + extra)
    return load_model_file(path)


def _twin(card: str) -> FakeDevice:
    return FakeDevice("16GiB", gpu=find_gpu(card), never_runs_out=True, traces=True)


def _counted(monkeypatch) -> list[int]:
    made = [0]
    counted(monkeypatch, made)
    return made


@pytest.mark.parametrize(("card", "precision", "extra"), [("a100-80", "fp32", ""), ("t4", "fp16", ""),
                                                          ("a100-80", "bf16", SGD)], ids=["adamw", "fp16", "sgd"])
@pytest.mark.parametrize("steps", [1, 2, 3])
def test_made_optimizer_phases_leave_the_trace_of_computed_ones(tmp_path, monkeypatch, card, precision, extra, steps):
    mf = _model(tmp_path, extra)
    plan = Plan(4, 64, precision)
    monkeypatch.setattr(made_optim, "_CALLS", made_calls.MadeCalls(direct=True))  # (this test's patterns only)
    made = _counted(monkeypatch)
    recorded_trial(mf, plan, _twin(card), steps, LOCAL, run_trial)  # the first of each kind, computed
    made[0] = 0
    result, bd = recorded_trial(mf, plan, _twin(card), steps, LOCAL, run_trial)
    assert made[0] == steps + 1 + (steps > 1)  # clipping on each step; the step on the first and on the last
    monkeypatch.setattr(made_optim, "fake_call", lambda *a: None)  # every call computed
    computed, computed_bd = recorded_trial(mf, plan, _twin(card), steps, LOCAL, run_trial)
    assert made[0] == steps + 1 + (steps > 1)  # nothing more made: every call computed (the second of three
    # steps, made or computed, runs on the first's made state)
    assert result.trace == computed.trace and result.trace is not None
    for figure in ("peak_bytes", "peak_allocated_bytes", "phase_peaks", "modelled_reserved_bytes", "host_peak_bytes"):
        assert getattr(result, figure) == getattr(computed, figure), figure
    assert bd == computed_bd and (steps == 1 or bd.optimizer_state_bytes > 4096)  # (AdamW's or SGD's state)


def test_a_model_files_own_optimizer_class_and_real_tensors_are_computed(tmp_path, monkeypatch):
    """devices: fake and cpu. The model file's subclass of SGD may keep more than its tensors: its step is computed
    (its clipping is made); on the cpu nothing is made, and the optimizer's state holds values."""
    monkeypatch.setattr(made_optim, "_CALLS", made_calls.MadeCalls(direct=True))
    made = _counted(monkeypatch)
    mf = _model(tmp_path, OWN)
    for _ in range(2):
        assert not run_trial(mf, Plan(4, 64, "fp32"), _twin("a100-80"), 1).oom
    assert made[0] == 1 and [k[0] for k in made_optim._CALLS.patterns] == ["clip"]
    made[0] = 0
    steps = []
    monkeypatch.setattr(torch.optim.AdamW, "step", _watching(torch.optim.AdamW.step, steps))
    result = run_trial(_model(tmp_path), Plan(4, 64, "fp32"), CpuDevice("1GiB"), 1)
    assert not result.oom and made[0] == 0 and steps and all(steps)


def _watching(step, seen: list):
    def watched(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        seen.append(all(not isinstance(v, torch._subclasses.FakeTensor) and torch.isfinite(v).all()
                        for s in self.state.values() for v in s.values() if isinstance(v, torch.Tensor)))
        return out

    return watched


def test_the_estimate_with_made_optimizer_phases_answers_as_with_them_computed(tmp_path, monkeypatch):
    """device: fake, a card's rules (T4). The tiny GPT's whole ladder, where trials make their second step from the
    first (the state a made step made is in it): the same plan, breakdown and figures for every trial."""
    args = ["estimate", EXAMPLES / "tiny_gpt.py", "--gpu", "t4", "--budget", "700MiB", "--batch", "64", "--context",
            "256", "--json"]
    monkeypatch.setattr(made_optim, "_CALLS", made_calls.MadeCalls(direct=True))
    made = _counted(monkeypatch)
    with_made = json.loads(run_cli(*args, "--out", tmp_path / "made.yaml").stdout)
    assert made[0] > 5 and "first-step-run" in [t["source"] for t in with_made["trials"]]
    monkeypatch.setattr(made_optim, "fake_call", lambda *a: None)
    computed = json.loads(run_cli(*args, "--out", tmp_path / "computed.yaml").stdout)
    assert with_made["plan"] == computed["plan"] and with_made["breakdown"] == computed["breakdown"]
    assert [(t["rung"], t["micro_batch_size"], t["peak_bytes"], t["source"]) for t in with_made["trials"]] == \
        [(t["rung"], t["micro_batch_size"], t["peak_bytes"], t["source"]) for t in computed["trials"]]
