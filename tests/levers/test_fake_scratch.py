"""The 8-bit AdamW's chunks on fake tensors made from the first of their kind (levers/fake_scratch.py): a trial's
figures and trace (every storage's birth, size and death, in order) equal those with every chunk computed, and so
does the breakdown of its peak; real tensors (the cpu device) are always computed. Device: fake (the estimate's
never-out twin with a card's rules, which traces), and cpu."""

from __future__ import annotations

import dataclasses

import pytest

from oomtune.config.schema import Plan
from oomtune.dist.group import LOCAL
from oomtune.levers import adamw8bit
from oomtune.levers.fake_scratch import FakeScratch
from oomtune.memory import made_calls, made_optim
from oomtune.memory.breakdown import recorded_trial
from oomtune.memory.devices import CpuDevice
from oomtune.model_file import load_model_file
from oomtune.search.trial import run_trial

from ..conftest import EXAMPLES
from ..search.test_block_extrapolation import MODELS, _deeper, _twin

CKPT = Plan(2, 32, "bf16", activation_checkpointing=True, optimizer_8bit=True)
CASES = [  # (model, plan, blocks a chunk: CHUNK_BLOCKS, small enough to slice the tiny models' weights)
    (EXAMPLES / "tiny_gpt.py", Plan(2, 32, "fp32", optimizer_8bit=True), adamw8bit.CHUNK_BLOCKS),
    (EXAMPLES / "tiny_gpt.py", CKPT, 16),
    (EXAMPLES / "tiny_gpt.py", dataclasses.replace(CKPT, precision="bf16-true", offload_optimizer=True), 16),
    ("wide", Plan(1, 64, "bf16-true", activation_checkpointing=True, optimizer_8bit=True, nf4_frozen_weights=True),
     1),
    (MODELS / "hf_llama_lora.py", dataclasses.replace(CKPT, grad_accum_steps=2, global_batch_size=4), 3),
]


def _counted(monkeypatch, made: list[int]):
    real = made_calls.made

    def make(pattern, written=(), direct=False):
        made[0] += 1
        return real(pattern, written, direct)

    monkeypatch.setattr(made_calls, "made", make)


@pytest.mark.parametrize(("source", "plan", "chunk"), CASES,
                         ids=lambda c: c if isinstance(c, str) else getattr(c, "stem", None))
def test_made_chunks_leave_the_trace_of_computed_ones(tmp_path, monkeypatch, source, plan, chunk):
    path = _deeper(tmp_path, MODELS / "hf_llama_lora.py", 2, wide=True) if source == "wide" else source
    if "lora" in path.name or source == "wide":  # adapters of 16 x 256 = 4096 elements: 8-bit moments
        text = path.read_text().replace("LoraConfig(r=4,", "LoraConfig(r=16,")
        text = text.replace("hidden_size=64,", "hidden_size=256,")
        path = tmp_path / "lora16.py"
        path.write_text(text)
    mf = load_model_file(path)
    monkeypatch.setattr(adamw8bit, "CHUNK_BLOCKS", chunk)
    monkeypatch.setattr(made_optim, "fake_call", lambda *a: None)  # (the clipping computed: the chunks counted)
    with monkeypatch.context() as m:  # what a process makes once (its first NF4 weight's two 64-byte host storages,
        m.setattr(FakeScratch, "kind", staticmethod(lambda *a: None))  # ...) made before: run alone, the made trial
        recorded_trial(mf, plan, _twin(), 2, LOCAL, run_trial)  # had them and the computed one after it not
    made = [0]
    _counted(monkeypatch, made)
    result, bd = recorded_trial(mf, plan, _twin(), 2, LOCAL, run_trial)
    assert made[0] > 0  # (some chunk was made: else the test proves nothing)
    monkeypatch.setattr(FakeScratch, "kind", staticmethod(lambda *a: None))  # every chunk computed
    computed, computed_bd = recorded_trial(mf, plan, _twin(), 2, LOCAL, run_trial)
    assert result.trace == computed.trace and result.trace is not None
    for figure in ("peak_bytes", "peak_allocated_bytes", "phase_peaks", "modelled_reserved_bytes", "host_peak_bytes"):
        assert getattr(result, figure) == getattr(computed, figure), figure
    assert bd == computed_bd


def test_a_memory_snapshot_computes_every_chunk(monkeypatch):
    """device: fake. A memory snapshot shows each storage's op and the Python frames that made it: its trial
    computes every chunk (none made), so the snapshot is the one of the optimizer's own ops."""
    from oomtune.memory.breakdown import snapshot
    from oomtune.memory.devices import FakeDevice

    monkeypatch.setattr(adamw8bit, "CHUNK_BLOCKS", 5)
    made = [0]
    _counted(monkeypatch, made)
    snap = snapshot(load_model_file(EXAMPLES / "tiny_gpt.py"), CKPT, FakeDevice("1GiB"))
    assert snap and made[0] == 0


def test_real_tensors_are_always_computed(monkeypatch):
    """device: cpu. The tiny GPT's 8-bit step with chunks of 5 blocks: nothing made, the moments hold values."""
    monkeypatch.setattr(adamw8bit, "CHUNK_BLOCKS", 5)
    made = [0]
    _counted(monkeypatch, made)
    mf = load_model_file(EXAMPLES / "tiny_gpt.py")
    result = run_trial(mf, CKPT, CpuDevice("1GiB"))
    assert not result.oom and made[0] == 0
