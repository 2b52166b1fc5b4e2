"""The bench's model files of published recipes (bench/models), built at a tiny shape of the same config (their
CONFIG pointed at a small Llama config): they build, train on the cpu device, and the fake device's estimate equals
the cpu's to the byte."""

from __future__ import annotations

import importlib
import json
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from oomtune.config.schema import Plan
from oomtune.memory.devices import CpuDevice, FakeDevice
from oomtune.memory.margin import Margin
from oomtune.model_file import load_model_file
from oomtune.search.trial import run_trial

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(any(find_spec(m) is None for m in ("transformers", "peft", "torchao")),
                                reason="needs transformers, peft and torchao")


@pytest.fixture
def small_llama32(tmp_path):
    config = json.loads((ROOT / "examples" / "hf" / "llama-3.2-3b" / "config.json").read_text())
    config.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=1024)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_torchtune_qlora_stores_only_the_adapted_projections_in_nf4(small_llama32, monkeypatch):
    module = importlib.import_module("bench.models.torchtune_llama3_2_3b_qlora")
    monkeypatch.setattr(module, "CONFIG", small_llama32)
    torch.manual_seed(0)
    model = module.build_model()
    nf4 = {n.split(".")[-3] for n, p in model.named_parameters() if type(p).__name__ == "NF4Tensor"}
    assert nf4 == set(module.TARGETS)  # (the name before .base_layer.weight)
    k_proj = model.get_base_model().model.layers[0].self_attn.k_proj
    assert type(k_proj) is torch.nn.Linear and k_proj.weight.dtype == torch.bfloat16
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    model_file = load_model_file(module.__file__)
    monkeypatch.setattr(model_file.module, "CONFIG", small_llama32)
    plan = Plan(2, 64, "bf16-true", activation_checkpointing=True, chunked_loss=True)
    cpu = run_trial(model_file, plan, CpuDevice("4GiB"))
    fake = run_trial(model_file, plan, FakeDevice("4GiB", margin=Margin()))
    assert not cpu.oom and cpu.loss == pytest.approx(6.93, abs=0.3)  # ln(1024): a LoRA that starts as its base
    assert fake.peak_allocated_bytes == cpu.peak_allocated_bytes
