"""NF4 weights on fake tensors: their dequantization (per use) and quantization (per build) made from the first call
of their kind (memory/made_nf4.py, memory/made_calls.py). A trial's figures, its trace (every storage's birth, size
and death, in order) and its breakdown equal those with every call computed: for the NF4 lever's weights (forward,
checkpointing's recomputation and backward; a second trial whose quantization is made from the first trial's), and
for NF4 weights a model file makes itself. Real tensors are always computed, and so is a memory snapshot's trial.
Devices: fake (the estimate's never-out twin with a card's rules, which traces) and cpu."""

from __future__ import annotations

from importlib.util import find_spec

import pytest

from oomtune.config.schema import Plan
from oomtune.dist.group import LOCAL
from oomtune.memory import made_calls, made_nf4, made_optim
from oomtune.memory.breakdown import recorded_trial
from oomtune.memory.devices import CpuDevice, FakeDevice
from oomtune.model_file import load_model_file
from oomtune.search.trial import run_trial

from ..memory.test_fake_model_code import own_nf4_source
from ..search.test_block_extrapolation import MODELS, _deeper, _twin
from .test_fake_scratch import _counted

pytestmark = pytest.mark.skipif(find_spec("torchao") is None,
                                reason="torchao is not installed (pip install -e '.[dev]')")

NF4 = Plan(2, 64, "bf16-true", activation_checkpointing=True, nf4_frozen_weights=True)


def _lora_wide(tmp_path):
    path = _deeper(tmp_path, MODELS / "hf_llama_lora.py", 2, wide=True)
    text = path.read_text().replace("hidden_size=64,", "hidden_size=256,")
    out = tmp_path / "wide_lora.py"
    out.write_text(text)
    return out


def _same(made, computed):
    (result, bd), (run, run_bd) = made, computed
    assert result.trace == run.trace and result.trace is not None
    for figure in ("peak_bytes", "peak_allocated_bytes", "phase_peaks", "modelled_reserved_bytes", "host_peak_bytes"):
        assert getattr(result, figure) == getattr(run, figure), figure
    assert bd == run_bd


def test_made_nf4_calls_leave_the_trace_of_computed_ones(tmp_path, monkeypatch):
    """device: fake. The NF4 lever on a PEFT LoRA Llama with checkpointing: every dequantization after the first of
    its kind made, in forward, recomputation and backward; the second trial's quantization made from the first's."""
    mf = load_model_file(_lora_wide(tmp_path))
    monkeypatch.setattr(made_nf4, "QUANTIZED", made_calls.MadeCalls())  # (this test's patterns, not the process's)
    monkeypatch.setattr(made_optim, "fake_call", lambda *a: None)  # (the optimizer phase computed: NF4's counted)
    with monkeypatch.context() as m:  # what a process makes once, on its first NF4 weight (two 64-byte host
        m.setattr(made_nf4, "fake_call", lambda *a: None)  # storages), made before: run alone, the first trial
        recorded_trial(mf, NF4, _twin(), 2, LOCAL, run_trial)  # had them and the computed one not
    made = [0]
    _counted(monkeypatch, made)
    first = recorded_trial(mf, NF4, _twin(), 2, LOCAL, run_trial)
    in_first = made[0]
    second = recorded_trial(mf, NF4, _twin(), 2, LOCAL, run_trial)
    # 2 steps x (forward, recomputation, backward) x 2 layers x 7 NF4 linears = 84 uses, all made but the first of
    # each kind: 4 shapes (q and o, k and v, gate and up, down) x autocast's state (on in the forward and the
    # recomputation, off in backward) = 76; in the second trial also its build's 4 first quantizations of a shape
    assert (in_first, made[0] - in_first, made_nf4.QUANTIZED.made) == (76, 80, 4)
    monkeypatch.setattr(made_nf4, "fake_call", lambda *a: None)  # every call computed
    computed = recorded_trial(mf, NF4, _twin(), 2, LOCAL, run_trial)
    _same(first, computed)
    _same(second, computed)


def test_nf4_weights_a_model_file_makes_itself_are_dequantized_as_made(write_model, monkeypatch):
    """device: fake. torchtune's way (the model file's own to_nf4): its weights' uses made, the trace the same."""
    mf = load_model_file(write_model(own_nf4_source()))
    plan = Plan(2, 64, "bf16-true", activation_checkpointing=True)
    made = [0]
    _counted(monkeypatch, made)
    result = recorded_trial(mf, plan, _twin(), 2, LOCAL, run_trial)
    assert made[0] > 0
    monkeypatch.setattr(made_nf4, "fake_call", lambda *a: None)
    _same(result, recorded_trial(mf, plan, _twin(), 2, LOCAL, run_trial))


def test_real_tensors_and_a_snapshot_compute_every_nf4_call(tmp_path, monkeypatch):
    """devices: cpu (real tensors) and fake (a memory snapshot shows each storage's op and frames): nothing made."""
    from oomtune.memory.breakdown import snapshot

    mf = load_model_file(_lora_wide(tmp_path))
    made = [0]
    _counted(monkeypatch, made)
    assert not run_trial(mf, NF4, CpuDevice("2GiB")).oom
    assert snapshot(mf, NF4, FakeDevice("2GiB"))
    assert made[0] == 0
