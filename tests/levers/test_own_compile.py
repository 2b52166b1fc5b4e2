"""A model file's own torch.compile (torch.compile(model), a module's .compile()) on the simulated devices, where
Dynamo runs nothing under the memory tracker: traced as --compile traces it (levers/compile.trace_own_compile), on
the cpu and fake devices alike, with eager's loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from oomtune.config.schema import Plan
from oomtune.memory.compiled import compile_notes
from oomtune.memory.devices import CpuDevice, FakeDevice
from oomtune.model_file import is_compiled, load_model_file
from oomtune.search.trial import run_trial
from oomtune.step import build_training

from ..conftest import run_cli

LORA_LLAMA = Path(__file__).parents[1] / "finetune" / "models" / "hf_llama_lora.py"


def _compiled_by_build_model(folder: Path, compile_call: str) -> Path:
    """The LoRA Llama's model file whose build_model() returns `compile_call`, an expression of its `model`."""
    text = LORA_LLAMA.read_text()
    built = "get_peft_model(LlamaForCausalLM(config), lora)"
    assert f"    return {built}\n" in text
    path = folder / "own_compile.py"
    path.write_text(text.replace(f"    return {built}\n", f"    model = {built}\n    return {compile_call}\n"))
    return path


@pytest.mark.parametrize("compile_call", ["torch.compile(model)", "model.base_model.model.model.compile() or model"],
                         ids=["torch.compile(model)", "a submodule's .compile()"])
@pytest.mark.parametrize("levers", [{}, {"precision": "bf16-true", "activation_checkpointing": True}],
                         ids=["fp32", "bf16-true+checkpointing"])
def test_a_model_build_model_compiled_is_traced_as_compile_traces_it(tmp_path, compile_call, levers):
    """devices: cpu and fake. build_model() returning torch.compile(model) (or compiling a submodule) ran eager on
    the simulated devices (Dynamo runs nothing under the memory tracker) and was estimated as eager: it is traced
    as --compile traces the same model (per block and the loss), to the byte, on both devices, with eager's loss."""
    own = load_model_file(_compiled_by_build_model(tmp_path, compile_call))
    plan = Plan(micro_batch_size=4, context_length=64, **levers)
    torch.manual_seed(0)
    cpu = run_trial(own, plan, CpuDevice("1GiB"))
    fake = run_trial(own, plan, FakeDevice("1GiB"))
    torch.manual_seed(0)
    flag = run_trial(load_model_file(LORA_LLAMA), Plan(micro_batch_size=4, context_length=64, compile=True, **levers),
                     CpuDevice("1GiB"))
    torch.manual_seed(0)
    eager = run_trial(load_model_file(LORA_LLAMA), plan, CpuDevice("1GiB"))
    assert cpu.peak_allocated_bytes == fake.peak_allocated_bytes == flag.peak_allocated_bytes
    step = ("forward", "backward", "optimizer")  # (the build's peak differs by 4.5 KiB between the devices, eager too)
    assert [cpu.phase_peaks[p] for p in step] == [fake.phase_peaks[p] for p in step] == \
        [flag.phase_peaks[p] for p in step]
    assert cpu.peak_allocated_bytes < eager.peak_allocated_bytes
    assert cpu.loss == pytest.approx(eager.loss, rel=1e-5)
    assert compile_notes() == ()  # every block and the loss traced


def test_a_compiled_part_of_the_model_is_traced_alone(tmp_path):
    """devices: cpu and fake. build_model() compiling one part (the output head), not the blocks: that part alone is
    traced (the blocks stay eager), the same to the byte on both devices, with eager's loss."""
    own = load_model_file(_compiled_by_build_model(tmp_path, "model.base_model.model.lm_head.compile() or model"))
    plan = Plan(micro_batch_size=4, context_length=64)
    torch.manual_seed(0)
    cpu = run_trial(own, plan, CpuDevice("1GiB"))
    fake = run_trial(own, plan, FakeDevice("1GiB"))
    torch.manual_seed(0)
    eager = run_trial(load_model_file(LORA_LLAMA), plan, CpuDevice("1GiB"))
    blocks = run_trial(load_model_file(LORA_LLAMA), Plan(micro_batch_size=4, context_length=64, compile=True),
                       CpuDevice("1GiB"))
    assert cpu.peak_allocated_bytes == fake.peak_allocated_bytes
    assert cpu.peak_allocated_bytes != blocks.peak_allocated_bytes, "every block was compiled"
    assert cpu.loss == pytest.approx(eager.loss, rel=1e-5)
    assert compile_notes() == ()


def test_a_compiled_model_without_blocks_is_traced_whole(tmp_path):
    """device: fake. A compiled nn.Sequential (no blocks): traced whole, below its eager self; the note says how."""
    compiled = Path(__file__).parents[1] / "finetune" / "models" / "compiled.py"
    eager = tmp_path / "eager.py"
    eager.write_text(compiled.read_text().replace("torch.compile(nn.Sequential(", "(nn.Sequential("))
    args = ("--micro-batch", "64", "--budget", "1GiB", "--margin", "0", "--json")
    r = run_cli("estimate", compiled, *args)
    assert r.exit_code == 0, r.output
    report, plain = json.loads(r.stdout), json.loads(run_cli("estimate", eager, *args).stdout)
    assert report["breakdown"]["tensor_peak_bytes"] < plain["breakdown"]["tensor_peak_bytes"]
    assert any("traced as --compile traces" in n for n in report["notes"]), report["notes"]
    assert not any(n.startswith("compiled ") for n in report["notes"])  # (nothing ran eager)


NESTED = """
import torch
import torch.nn.functional as F
from torch import nn


def build_model():
    inner = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    inner.compile()
    return torch.compile(nn.Sequential(inner, nn.GELU(), nn.Linear(256, 8)))


def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, 256, device=device), torch.randint(0, 8, (batch_size,), device=device)


def loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)
"""


def test_a_compiled_module_inside_another_is_traced_as_part_of_it(write_model):
    """devices: cpu and fake. A module compiled inside a compiled one (no blocks): the outer one traced whole, the
    inner one as part of its graph (wrapping both crashed the trial), the same to the byte on both devices, with
    eager's loss."""
    mf = load_model_file(write_model(NESTED))
    plan = Plan(micro_batch_size=2048, context_length=1)  # (activations, not the weights, set the peak)
    torch.manual_seed(0)
    cpu = run_trial(mf, plan, CpuDevice("1GiB"))
    fake = run_trial(mf, plan, FakeDevice("1GiB"))
    eager_mf = load_model_file(write_model(NESTED.replace("    inner.compile()\n", "").replace("torch.compile(", "("),
                                           name="eager.py"))
    torch.manual_seed(0)
    eager = run_trial(eager_mf, plan, CpuDevice("1GiB"))
    assert cpu.peak_allocated_bytes == fake.peak_allocated_bytes < eager.peak_allocated_bytes
    assert cpu.loss == pytest.approx(eager.loss, rel=1e-5)
    assert compile_notes() == ()


@pytest.mark.parametrize(("compile_call", "plan_compiles"), [
    ("[layer.compile() for layer in model.base_model.model.model.layers] and model", False),  # torchtune's way
    ("model.base_model.model.lm_head.compile() or model", True)],  # a part, with the plan's compile too
    ids=["each block compiled", "a part, and --compile"])
def test_compiled_blocks_or_the_plans_compile_trace_per_block(tmp_path, compile_call, plan_compiles):
    """devices: cpu and fake. A model file that compiles each block itself, or one that compiles a part under a
    plan with compile on: traced per block and the loss, as --compile alone traces the same model, to the byte;
    and what it built still counts as compiled (train's note)."""
    own = load_model_file(_compiled_by_build_model(tmp_path, compile_call))
    plan = Plan(micro_batch_size=4, context_length=64, compile=plan_compiles)
    cpu, fake = run_trial(own, plan, CpuDevice("1GiB")), run_trial(own, plan, FakeDevice("1GiB"))
    flag = run_trial(load_model_file(LORA_LLAMA), Plan(micro_batch_size=4, context_length=64, compile=True),
                     CpuDevice("1GiB"))
    assert cpu.peak_allocated_bytes == fake.peak_allocated_bytes == flag.peak_allocated_bytes
    t = build_training(own, plan, CpuDevice("1GiB"), lr=1e-3)
    assert is_compiled(t.module)  # (Dynamo's wrappers are off: the trainer's note reads this)
