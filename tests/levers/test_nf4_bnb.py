"""bitsandbytes' 4-bit weights as a model file declares them (a BitsAndBytesConfig among its names) or a Hugging
Face folder (config.json's quantization_config): levers/nf4_bnb.py. Stored in bitsandbytes' layout (packed
uint8, an fp32 absmax per 64, or with double quantization a uint8 one, an fp32 scale per 256 of them and the two
maps), on every rung, dequantized by bitsandbytes in forward and backward. Devices: cpu (bitsandbytes computes)
and fake (its fake kernels; the quantization made with its shapes), whose peaks and forward, backward and optimizer
phases must agree to the byte."""

from __future__ import annotations

import json
import math
import shutil
import textwrap
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from oomtune.config.schema import Plan
from oomtune.memory.breakdown import static_memory
from oomtune.memory.devices import CpuDevice, FakeDevice
from oomtune.model_file import load_model_file
from oomtune.search.trial import run_trial

from ..conftest import run_cli

pytestmark = pytest.mark.skipif(find_spec("bitsandbytes") is None or find_spec("peft") is None,
                                reason="bitsandbytes is not installed (pip install -e '.[dev]' on linux x86-64)")

MODELS = Path(__file__).parent / "models"
QLORA = MODELS / "hf_llama_bnb_qlora.py"
N = 256 * 256

FROZEN = '''
import torch
from torch import nn
from transformers import BitsAndBytesConfig

bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=DQ)

def build_model():
    frozen, trained = nn.Linear(256, 256, bias=False), nn.Linear(256, 256, bias=False)
    frozen.weight.requires_grad_(False)
    return nn.Sequential(frozen, trained)

def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, 256, device=device)

def loss(model, batch):
    return model(batch).square().mean()
'''


def _frozen(tmp_path, dq: bool) -> Path:
    path = tmp_path / f"frozen_{dq}.py"
    path.write_text(textwrap.dedent(FROZEN).replace("DQ", str(dq)))
    return path


def _rounded(n: int) -> int:
    return -(-n // 512) * 512


@pytest.mark.parametrize("dq", [False, True], ids=["nf4", "nf4-dq"])
def test_the_declared_layout_is_bitsandbytes_own_on_every_plan_and_leaves_no_nf4_lever(tmp_path, dq):
    """device: fake (static memory). The frozen weight as bitsandbytes stores it, the trained one fp32, with no
    plan at all (the model is 4-bit as built) and under a plan: ~0.563 bytes an element, ~0.516 double-quantized
    (here more: each storage is 512-byte rounded)."""
    mf = load_model_file(_frozen(tmp_path, dq))
    blocks = N // 64
    packed, code = N // 2, _rounded(16 * 4)
    if dq:  # uint8 absmax, fp32 scale per 256 of them, their mean, the 256-value map
        stored = packed + _rounded(blocks) + _rounded(4 * math.ceil(blocks / 256)) + 512 + code + _rounded(256 * 4)
    else:
        stored = packed + _rounded(4 * blocks) + code
    for s in (static_memory(mf), static_memory(mf, Plan(1, 1), "")):
        assert s.weights_bytes == stored + 4 * N and s.gradients_bytes == 4 * N
        assert s.nf4_elements == 0  # nothing left for the NF4 lever


def test_the_real_quantization_stores_what_the_fake_one_makes(tmp_path):
    """devices: cpu against fake. bitsandbytes' own quantize_4bit on real weights and the made one on fake tensors
    keep the same tensors: a trial's peak and its forward, backward and optimizer phases are equal to the byte."""
    mf = load_model_file(QLORA)
    for plan in (Plan(4, 64), Plan(4, 64, "bf16"), Plan(4, 64, "bf16-true", activation_checkpointing=True)):
        torch.manual_seed(0)
        cpu = run_trial(mf, plan, CpuDevice("1GiB"))
        fake = run_trial(mf, plan, FakeDevice("1GiB"))
        assert not cpu.oom and not fake.oom
        assert cpu.peak_allocated_bytes == fake.peak_allocated_bytes
        # the setup phase is 2,560 B higher on cpu with torchao's NF4 lever and offloaded activations too: not here
        assert {k: v for k, v in cpu.phase_peaks.items() if k != "setup"} == \
            {k: v for k, v in fake.phase_peaks.items() if k != "setup"}
        assert math.isfinite(cpu.loss)


def test_forward_and_backward_dequantize_the_whole_weight_each_time(tmp_path):
    """device: cpu. One frozen 256 x 256 weight in bitsandbytes' layout, fp32, with an input that needs its gradient:
    its forward and its backward each hold the dequantized weight (256 KiB) for their matmul, and nothing of it is
    kept between them; the input's gradient and the trained layer's are those of the same model with the
    dequantized weight as a plain Linear."""
    from oomtune.levers import build_model
    from oomtune.levers.nf4_bnb import dequantized

    mf = load_model_file(_frozen(tmp_path, True))
    device = CpuDevice("1GiB")
    with device.measure():
        model = build_model(mf, Plan(8, 1), device)
        x = torch.randn(8, 256, requires_grad=True)
        before = device.live_bytes()
        device.tracker.reset_peak()
        out = model(x)
        assert device.tracker.peak_bytes - before >= 4 * N + 8 * 256 * 4  # the whole fp32 weight beside its output
        kept = device.live_bytes() - before
        assert kept < 4 * N  # not kept for backward
        loss = out.square().mean()
        device.tracker.reset_peak()
        during = device.live_bytes()
        loss.backward()
        assert device.tracker.peak_bytes - during >= 4 * N  # dequantized again for the input's gradient
        weight = dequantized(model[0])
    plain = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False), torch.nn.Linear(256, 256, bias=False))
    plain[0].weight.data.copy_(weight)
    plain[0].weight.requires_grad_(False)
    plain[1].weight.data.copy_(model[1].weight.detach())
    y = x.detach().clone().requires_grad_(True)
    plain(y).square().mean().backward()
    assert torch.allclose(plain[1].weight.grad, model[1].weight.grad, rtol=1e-5, atol=1e-7)
    assert torch.allclose(y.grad, x.grad, rtol=1e-5, atol=1e-7)
    assert weight.shape == (256, 256) and weight.dtype == torch.float32


def test_a_folder_saved_4bit_is_read_as_its_quantization_config_says(tmp_path):
    """device: fake. A Hugging Face folder whose config.json carries bitsandbytes' 4-bit quantization_config (a
    checkpoint saved quantized) is 4-bit on every rung, and the estimate says so; without LoRA it has no frozen
    weight to store so (one line, exit 2)."""
    folder = tmp_path / "llama-bnb"
    shutil.copytree(Path(__file__).parents[2] / "examples" / "hf" / "tiny-llama", folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                     "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": False}
    (folder / "config.json").write_text(json.dumps(config))
    args = ("estimate", folder, "--budget", "1GiB", "--micro-batch", "2", "--context", "32", "--json")
    r = run_cli(*args)
    assert r.exit_code == 2 and "frozen nn.Linear weights, and the model has none" in r.stderr
    quantized = run_cli(*args, "--lora-r", "4")
    assert quantized.exit_code == 0, quantized.stderr
    out = json.loads(quantized.stdout)
    assert any("in bitsandbytes nf4, bitsandbytes' layout, on every rung" in n for n in out["notes"])
    # its weights saved quantized (bitsandbytes' Linear4bit on loading): train says it cannot start from them yet
    (folder / "model.safetensors").write_bytes(b"")
    assert run_cli("estimate", folder, "--budget", "1GiB", "--batch", "2", "--context", "32", "--lora-r", "4",
                   "--out", tmp_path / "q.yaml").exit_code == 0
    trained = run_cli("train", "--config", tmp_path / "q.yaml", "--steps", "1", "--run-dir", tmp_path / "run")
    assert trained.exit_code == 2 and "its weights are saved quantized" in trained.stderr, trained.output
    (folder / "model.safetensors").unlink()
    config.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(config))
    plain = json.loads(run_cli(*args, "--lora-r", "4").stdout)
    assert out["breakdown"]["parameters_bytes"] < plain["breakdown"]["parameters_bytes"] / 2


def test_an_8bit_config_is_said_not_modelled(tmp_path):
    """device: fake. BitsAndBytesConfig(load_in_8bit=True) (LLM.int8) is not modelled: the weights are estimated as
    built, and the estimate says so rather than leave it silent."""
    path = tmp_path / "eight.py"
    path.write_text(textwrap.dedent(FROZEN).replace("load_in_4bit=True, bnb_4bit_use_double_quant=DQ",
                                                    "load_in_8bit=True"))
    r = run_cli("estimate", path, "--budget", "1GiB", "--micro-batch", "2", "--context", "1", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert any("loads 8-bit weights (LLM.int8), which oomtune does not model" in n for n in out["notes"])
    assert out["breakdown"]["parameters_bytes"] == 2 * 4 * N  # both weights as built, fp32


@pytest.mark.parametrize(("skip", "quantized"), [
    (None, 14),  # every frozen projection of the 2 layers, the output head kept
    ("", 15),  # an empty list: nothing skipped, the head quantized too (transformers adds no default skips then)
    ("'mlp'", 9),  # the attention projections, and the head: a skip list given quantizes it too (transformers')
    ("'model.layers.0'", 8),  # a prefix at a dot
    ("'model.layers.0.self_attn.q_proj'", 14),  # one module by its full name: 13 projections and the head
    (r"r'model\.layers\.\d+\.mlp\..*'", 9),  # a regular expression
])
def test_skip_modules_are_matched_as_transformers_matches_them(tmp_path, skip, quantized):
    """device: cpu. llm_int8_skip_modules names modules by the model's own names, which PEFT's wrapping renames
    (base_model.model. ... .base_layer): each kind of entry keeps its modules as built."""
    from oomtune.levers import build_model

    text = QLORA.read_text()
    if skip is not None:
        text = text.replace("bnb_4bit_compute_dtype=torch.bfloat16)",
                            f"bnb_4bit_compute_dtype=torch.bfloat16, llm_int8_skip_modules=[{skip}])")
    path = tmp_path / "skipping.py"
    path.write_text(text)
    device = CpuDevice("1GiB")
    with device.measure():
        model = build_model(load_model_file(path), Plan(1, 1), device)
        assert sum(hasattr(m, "bnb_4bit") for m in model.modules()) == quantized


@pytest.mark.parametrize(("flag", "says"), [(("--compile",), "plan.compile cannot trace bitsandbytes"),
                                            (("--levers", "nf4"), "plan.nf4_frozen_weights (torchao's NF4) has "
                                                                  "nothing left to store")])
def test_what_cannot_run_with_declared_4bit_weights_is_one_line(flag, says):
    """device: fake. A compiled plan (AOTAutograd cannot trace bitsandbytes' dequantization of a layer's own
    buffers: it ran eager, estimated 33% under the cpu device's trial) and torchao's NF4 lever on a model that
    declares bitsandbytes' 4-bit weights: one line, exit 2, not a silently wrong figure."""
    r = run_cli("estimate", QLORA, "--budget", "1GiB", "--micro-batch", "2", "--context", "32", *flag)
    assert r.exit_code == 2 and says in r.stderr, r.output
    assert len([line for line in r.stderr.splitlines() if line.strip()]) == 1


def test_a_build_model_that_loads_4bit_itself_is_told_how_to_declare_it(tmp_path):
    """device: fake. from_pretrained(..., quantization_config=...) inside build_model makes bitsandbytes' own
    Params4bit, which cannot wrap the simulated devices' tensors: the one line says what to write instead."""
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                 num_attention_heads=4)).save_pretrained(tmp_path / "tiny")
    path = tmp_path / "loads_4bit.py"
    path.write_text(textwrap.dedent(f"""
        import torch
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        def build_model():
            bnb = BitsAndBytesConfig(load_in_4bit=True)
            return AutoModelForCausalLM.from_pretrained({str(tmp_path / "tiny")!r}, quantization_config=bnb)

        def make_batch(batch_size, context_length, device):
            ids = torch.randint(0, 256, (batch_size, context_length), device=device)
            return {{"input_ids": ids, "labels": ids}}
    """))
    r = run_cli("estimate", path, "--budget", "1GiB", "--micro-batch", "2", "--context", "16")
    assert r.exit_code == 2 and "return the model unquantized and define the BitsAndBytesConfig" in r.stderr, r.output


def test_the_compute_dtype_is_what_the_weight_is_dequantized_to_and_computed_in(tmp_path):
    """device: cpu. bnb_4bit_compute_dtype=bfloat16 on an fp32 model (a guide's QLoRA loads the base in bf16 and
    computes in it): the weight is quantized from bf16, each use dequantizes it to bf16 (half the fp32 transient),
    the layer computes in bf16 and hands back fp32, as bitsandbytes' Linear4bit."""
    from oomtune.levers import build_model
    from oomtune.levers.nf4_bnb import dequantized

    path = tmp_path / "bf16_compute.py"
    path.write_text(textwrap.dedent(FROZEN).replace("bnb_4bit_use_double_quant=DQ",
                                                    "bnb_4bit_use_double_quant=False, "
                                                    "bnb_4bit_compute_dtype=torch.bfloat16"))
    device = CpuDevice("1GiB")
    with device.measure():
        model = build_model(load_model_file(path), Plan(8, 1), device)
        x = torch.randn(8, 256)
        before = device.live_bytes()
        device.tracker.reset_peak()
        out = model[0](x)
        held = device.tracker.peak_bytes - before
        assert out.dtype == torch.float32 and dequantized(model[0]).dtype == torch.bfloat16
        assert 2 * N <= held < 4 * N  # the bf16 weight (and the bf16 input, output), not an fp32 one


def test_without_bitsandbytes_a_declared_model_is_one_line(monkeypatch):
    """device: fake. Where bitsandbytes is not installed, a model that declares its 4-bit weights is one line naming
    the library, exit 2 (not the float weights estimated in silence)."""
    import oomtune.levers as levers

    real = levers.installed
    monkeypatch.setattr(levers, "installed", lambda name: name != "bitsandbytes" and real(name))
    r = run_cli("estimate", QLORA, "--budget", "1GiB", "--micro-batch", "2", "--context", "32")
    assert r.exit_code == 2 and "they need bitsandbytes" in r.stderr, r.output


def test_an_older_bitsandbytes_is_one_line(monkeypatch):
    """device: fake. bitsandbytes before 0.47 has no 4-bit kernels off the GPU, and before 0.43.2 each 4-bit layer
    kept its input for backward (litgpt pins 0.42): modelled as today's, its QLoRA would be estimated low (litgpt's
    published 7B QLoRA run: 17%). One line naming the version, exit 2."""
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.42.0" if name == "bitsandbytes" else real(name))
    r = run_cli("estimate", QLORA, "--budget", "1GiB", "--micro-batch", "2", "--context", "32")
    assert r.exit_code == 2 and "bitsandbytes 0.42.0 is installed, and oomtune models bitsandbytes 0.47" in r.stderr
    assert len([line for line in r.stderr.splitlines() if line.strip()]) == 1
