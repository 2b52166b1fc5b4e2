"""The levers past accumulation, part by part: what each stores, by arithmetic a reader can redo, and the cpu device
(real tensors) against the fake one (no data) on every new rung. Devices: static_memory runs on fake tensors; the
comparisons run both cpu and fake."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from oomtune.config.schema import Plan
from oomtune.levers.adamw8bit import BLOCK, BlockwiseAdamW8bit, dequantize, quantize
from oomtune.memory.breakdown import static_memory
from oomtune.memory.devices import CpuDevice, FakeDevice
from oomtune.model_file import load_model_file
from oomtune.search.trial import run_trial

from ..conftest import EXAMPLES, ROOT

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
needs_hf = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs transformers and peft")

N = 256 * 1024  # elements per weight below: whole 512-byte storages in every dtype, whole blocks for 8-bit and NF4

# two trained Linear weights of N elements, no biases
TRAINED = '''
from torch import nn
import torch

def build_model():
    return nn.Sequential(nn.Linear(256, 1024, bias=False), nn.Linear(1024, 256, bias=False))

def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, 256, device=device), torch.randn(batch_size, 256, device=device)

def loss(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()
'''

# a frozen Linear of N elements (the NF4 lever's target) and a trained one of N
FROZEN = TRAINED.replace("return nn.Sequential(", "model = nn.Sequential(").replace(
    "bias=False))\n", "bias=False))\n    model[0].weight.requires_grad_(False)\n    return model\n", 1)


def test_bf16_true_holds_8_bytes_a_parameter_with_adamw(write_model):
    mf = load_model_file(write_model(TRAINED))
    fp32, true = static_memory(mf), static_memory(mf, Plan(1, 1, "bf16-true"), "bf16-true")
    steps = 2 * 512  # AdamW's step count, an fp32 scalar (one 512-byte block) per parameter
    assert fp32.total_bytes == 16 * 2 * N + steps  # weights 4 + gradients 4 + AdamW's two moments 8
    assert true.total_bytes == 8 * 2 * N + steps  # all of them in bf16: 2 + 2 + 4
    assert (true.weights_bytes, true.gradients_bytes, true.optimizer_bytes) == (2 * 2 * N, 2 * 2 * N,
                                                                                4 * 2 * N + steps)


def test_8bit_adamw_state_is_2_bytes_a_parameter_plus_a_scale_per_block(write_model):
    mf = load_model_file(write_model(TRAINED))
    s = static_memory(mf, Plan(1, 1, optimizer_8bit=True), "8bit")
    per_weight = 2 * (N + 4 * N // BLOCK)  # two moments: a byte each, and an fp32 scale per 256 elements
    assert s.optimizer_bytes == 2 * per_weight  # 2.03 bytes a parameter
    assert s.optimizer_name == "BlockwiseAdamW8bit" and s.weights_bytes == s.gradients_bytes == 4 * 2 * N


@needs_torchao
def test_nf4_frozen_weights_are_half_a_byte_plus_block_scales(write_model):
    mf = load_model_file(write_model(FROZEN))
    plain = static_memory(mf)
    s = static_memory(mf, Plan(1, 1, nf4_frozen_weights=True), "nf4")
    assert plain.nf4_elements == N and plain.weights_bytes == 4 * 2 * N
    # the frozen one: 4 bits an element, an int8 scale per 64, an fp32 factor per 256 scales, a mean, the 16 codes
    # (each storage 512-byte rounded: the last three are one block each)
    nf4 = N // 2 + N // 64 + 3 * 512
    assert s.weights_bytes == nf4 + 4 * N  # + the trained fp32 one
    assert abs(nf4 / N - 0.52) < 0.01
    assert s.gradients_bytes == 4 * N  # the trained one only


@needs_torchao
def test_the_breakdown_counts_nf4_weights_as_parameters(write_model):
    """device: fake. An NF4 weight is a wrapper tensor; its storages are its inner codes and scales, which the
    breakdown tagged as nothing (they showed as temporaries)."""
    from oomtune.memory.breakdown import breakdown

    mf = load_model_file(write_model(FROZEN))
    plan = Plan(4, 1, nf4_frozen_weights=True)
    bd = breakdown(mf, plan, FakeDevice("1GiB"))
    assert bd.parameters_bytes == static_memory(mf, plan, "nf4").weights_bytes == N // 2 + N // 64 + 3 * 512 + 4 * N


def test_the_offloaded_optimizer_holds_nothing_on_the_device_and_all_of_it_on_the_host(write_model):
    mf = load_model_file(write_model(TRAINED))
    s = static_memory(mf, Plan(1, 1, offload_optimizer=True), "offload")
    assert s.optimizer_bytes == s.gradients_bytes == 0  # the gradients too: moved as backward makes them
    assert s.weights_bytes == 4 * 2 * N
    assert s.host_bytes == (4 + 4 + 8) * 2 * N + 2 * 512  # the weights' copy, gradients, AdamW's state and steps


def test_the_offloaded_optimizers_gradient_hooks_go_with_it():
    """device: cpu. A probe's trials reuse one model, each with an optimizer of its own: an optimizer that is gone
    leaves no hook on the parameters."""
    from oomtune.levers.offload import HostOffloadOptimizer

    layer = nn.Linear(4, 4)
    for _ in range(3):
        optimizer = HostOffloadOptimizer(list(layer.parameters()), torch.optim.AdamW, CpuDevice("1GiB"))
        assert len(layer.weight._post_accumulate_grad_hooks) == 1
        del optimizer
    assert not layer.weight._post_accumulate_grad_hooks

def test_offloaded_activations_leave_the_device_and_come_back_for_backward(write_model):
    """device: cpu. The peak at the end of forward drops by what forward saved; the host holds it meanwhile."""
    mf = load_model_file(EXAMPLES / "tiny_gpt.py")
    plain = run_trial(mf, Plan(8, 128), CpuDevice("1GiB"))
    off = run_trial(mf, Plan(8, 128, offload_activations=True), CpuDevice("1GiB"))
    assert off.phase_peaks["forward"] < plain.phase_peaks["forward"] / 2
    assert off.host_peak_bytes > plain.phase_peaks["forward"] - off.phase_peaks["forward"] - (1 << 20)
    assert plain.host_peak_bytes == 0


PLANS = {
    "bf16-true": Plan(4, 64, "bf16-true", True),
    "8bit": Plan(4, 64, "bf16-true", True, optimizer_8bit=True),
    "offload": Plan(4, 64, "bf16-true", True, optimizer_8bit=True, offload_optimizer=True),
    "offload, AdamW": Plan(4, 64, "bf16-true", True, offload_optimizer=True),  # (primed by a step, not make_state)
    "offload-activations x2": Plan(4, 64, "bf16-true", True, 2, optimizer_8bit=True, offload_optimizer=True,
                                   offload_activations=True),
}


@pytest.mark.parametrize("name", PLANS)
def test_cpu_equals_fake_on_every_new_rung(name):
    """device: cpu and fake, the tiny GPT: the same step, the same bytes (the issue asks within 1%; it is exact)."""
    mf = load_model_file(EXAMPLES / "tiny_gpt.py")
    cpu, fake = run_trial(mf, PLANS[name], CpuDevice("1GiB")), run_trial(mf, PLANS[name], FakeDevice("1GiB"))
    assert not cpu.oom and cpu.peak_allocated_bytes == fake.peak_allocated_bytes
    assert cpu.host_peak_bytes == fake.host_peak_bytes


@needs_hf
@needs_torchao
def test_cpu_equals_fake_for_a_lora_model_with_every_lever():
    """device: cpu and fake: a PEFT LoRA Llama with NF4 base weights (14 projections), 8-bit state, both offloads."""
    from oomtune.levers.nf4 import frozen_linears

    mf = load_model_file(ROOT / "tests" / "levers" / "models" / "hf_llama_qlora.py")
    model = mf.build()
    assert len(frozen_linears(model)) == 14 and model.get_output_embeddings() not in frozen_linears(model)
    plan = Plan(2, 64, "bf16-true", True, optimizer_8bit=True, nf4_frozen_weights=True, offload_optimizer=True,
                offload_activations=True)
    run_trial(mf, plan, CpuDevice("1GiB"))  # the first in a process makes a 4 KiB cache inside the step, once
    cpu, fake = run_trial(mf, plan, CpuDevice("1GiB")), run_trial(mf, plan, FakeDevice("1GiB"))
    assert cpu.peak_allocated_bytes == fake.peak_allocated_bytes and cpu.host_peak_bytes == fake.host_peak_bytes
    bf16 = run_trial(mf, Plan(2, 64, "bf16", True), CpuDevice("1GiB"))
    assert cpu.peak_allocated_bytes < bf16.peak_allocated_bytes


def test_the_8bit_codes_keep_each_value_within_a_few_percent():
    torch.manual_seed(0)
    x = torch.randn(64 * BLOCK) * torch.logspace(-3, 0, 64 * BLOCK)
    for signed, v in ((True, x), (False, x.abs())):
        codes, scale = quantize(v, signed)
        assert codes.dtype == torch.uint8 and codes.shape == v.shape and scale.shape == (64,)
        back = dequantize(codes, scale, signed).reshape(-1)
        rel = ((back - v).abs() / v.abs())[v.abs() > 1e-4 * v.abs().max()]
        assert rel.max() < (0.06 if signed else 0.035)  # half a code step: 10^(6/127/2) and 10^(7/255/2)


def test_8bit_adamw_follows_fp32_adamw():
    """Both fit the same regression from the same start; the 8-bit moments end within noise of fp32's."""
    def fit(cls) -> list[float]:
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))  # 16384 and 256 weights: 8-bit
        opt = cls(model.parameters(), lr=1e-3)
        x = torch.randn(256, 64)
        y = x[:, :1] * 2 + x[:, 1:2].sin()
        losses = []
        for _ in range(150):
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    fp32, eight = fit(torch.optim.AdamW), fit(BlockwiseAdamW8bit)
    assert fp32[0] == eight[0] and eight[-1] < eight[0] * 0.05
    assert abs(eight[-1] - fp32[-1]) < 0.5 * fp32[-1] + 1e-3


@needs_torchao
def test_the_8bit_stand_ins_state_has_torchaos_dtypes_and_a_bf16_model_trains():
    """BlockwiseAdamW8bit keeps torchao's layout: a tensor it does not quantize keeps plain moments in the parameter's
    dtype (torchao's zeros_like(p): bf16 for a bf16 parameter; they were fp32, twice the bytes, so bf16-true LoRA
    adapters looked as if 8-bit grew their state), and the step still trains them."""
    from torchao.optim import AdamW8bit

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)).to(torch.bfloat16)  # 16384: 8-bit
    ours, theirs = BlockwiseAdamW8bit(model.parameters()), AdamW8bit(model.parameters())
    for p in model.parameters():
        mine = ours._init_state(p)
        if "exp_avg" in mine:
            assert mine["exp_avg"].dtype == theirs._new_buffer(p, True).dtype == torch.bfloat16
            assert mine["exp_avg"].untyped_storage().nbytes() == 2 * p.numel()
    x = torch.randn(128, 64, dtype=torch.bfloat16)
    y = x[:, :1] * 2
    first = None
    for _ in range(60):
        loss = ((model(x) - y) ** 2).float().mean()
        first = first or loss.item()
        ours.zero_grad()
        loss.backward()
        ours.step()
    assert loss.item() < 0.2 * first


def test_a_trial_with_every_lever_leaves_nothing_alive_on_the_device_or_the_host():
    """device: cpu. The offloaded optimizer's gradient hooks live on the parameters' C++ side, out of the garbage
    collector's sight: were they to hold the optimizer, nothing of the trial would ever be freed."""
    import gc

    mf = load_model_file(EXAMPLES / "mlp_dict.py")
    device = CpuDevice("1GiB")
    for _ in range(2):
        r = run_trial(mf, PLANS["offload-activations x2"], device)
        gc.collect()
        assert not r.oom and r.host_peak_bytes > 0
        assert device.live_bytes() == device.tracker.host_live_bytes == 0


@needs_torchao
def test_the_fake_devices_nf4_tensor_stores_what_torchaos_quantizer_stores():
    """The fake device builds NF4 weights without running the quantizer (nothing to compute on fake tensors): the
    same tensor subclass, the same inner tensors, shapes and dtypes as torchao's to_nf4 of real values."""
    from oomtune.levers.nf4 import library_to_nf4, nf4_like

    for shape, dtype in (((384, 512), torch.float32), ((256, 64), torch.float32), ((256, 128), torch.bfloat16)):
        weight = torch.randn(*shape, dtype=dtype)  # several blocks of scales; one (its factor keeps a bigger storage)
        real, like = library_to_nf4()(weight, 64, 256), nf4_like(weight)
        check_alike(real, like)


def check_alike(real, like):
    assert type(like) is type(real) and like.shape == real.shape and like.dtype == real.dtype
    names, ctx = real.__tensor_flatten__()
    like_names, like_ctx = like.__tensor_flatten__()
    assert names == like_names and {k: ctx[k] for k in ("block_size", "n_blocks", "scaler_block_size")} == \
        {k: like_ctx[k] for k in ("block_size", "n_blocks", "scaler_block_size")}
    for name in names:
        a, b = getattr(real, name), getattr(like, name)
        assert (a.shape, a.dtype, a.untyped_storage().nbytes()) == (b.shape, b.dtype, b.untyped_storage().nbytes())


SAME_SHAPES = '''
import torch
from torch import nn

def build_model():
    frozen = [nn.Linear(128, 128, bias=False) for _ in range(3)] + [nn.Linear(128, 256, bias=False)]
    for m in frozen:
        m.weight.requires_grad_(False)
    return nn.Sequential(*frozen, nn.Linear(256, 128))

def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, 128, device=device), torch.randn(batch_size, 128, device=device)

def loss(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()
'''


@needs_torchao
def test_nf4_weights_of_one_shape_cost_the_fake_device_one_quantization_and_the_same_bytes(write_model):
    """device: cpu and fake. Four frozen Linears of two shapes: the fake device runs torchao's quantizer on the first
    of each shape only, and its device and host peaks are the cpu device's (which quantizes all four) to the byte."""
    mf = load_model_file(write_model(SAME_SHAPES))
    plan = Plan(4, 1, nf4_frozen_weights=True)
    cpu, fake = run_trial(mf, plan, CpuDevice("1GiB")), run_trial(mf, plan, FakeDevice("1GiB"))
    assert cpu.host_peak_bytes > 0 and cpu.peak_allocated_bytes > 0
    assert (cpu.peak_allocated_bytes, cpu.host_peak_bytes) == (fake.peak_allocated_bytes, fake.host_peak_bytes)


@needs_hf
@needs_torchao
def test_a_gpt2_models_conv1d_projections_are_stored_in_nf4_and_compute_what_they_did():
    """device: cpu and fake. GPT-2's projections are Conv1D (x @ W + b, W stored (in, out)): NF4 stores each as the
    Linear it is, transposed, and its forward becomes F.linear. Each quantized layer computes what it did within
    NF4's own error (~9% of a layer's output for normal weights; a weight used the wrong way round is off by
    ~145%), and the fake device still measures what the cpu device does."""
    import copy

    from oomtune.levers.nf4 import frozen_linears, quantize_frozen
    from oomtune.memory.made_nf4 import is_nf4

    mf = load_model_file(ROOT / "tests" / "levers" / "models" / "hf_gpt2_qlora.py")
    model = mf.build().eval()
    layers = frozen_linears(model)
    assert len(layers) == 8 and all(type(m).__name__ == "Conv1D" for m in layers)  # c_attn, c_proj x2, c_fc / layer
    originals = [copy.deepcopy(m) for m in layers]
    assert quantize_frozen(model) == 8 and all(is_nf4(m.weight) for m in layers)
    with torch.no_grad():
        errors = []
        for original, quantized in zip(originals, layers, strict=True):
            x = torch.randn(4, 16, original.weight.shape[0])
            want = original(x)
            errors.append(((quantized(x) - want).norm() / want.norm()).item())
    print(f"GPT-2 Conv1D layers in NF4: relative error of each output {[round(e, 3) for e in errors]}")
    assert all(e < 0.15 for e in errors)
    # the forward comes from the layer's class, not bound on the instance (no reference cycle); a layer pickles
    import pickle

    assert all("forward" not in vars(m) for m in layers)
    x = torch.randn(2, 128)
    with torch.no_grad():
        assert torch.equal(pickle.loads(pickle.dumps(layers[0]))(x), layers[0](x))
    plan = Plan(2, 32, "bf16-true", True, nf4_frozen_weights=True)
    cpu, fake = run_trial(mf, plan, CpuDevice("1GiB")), run_trial(mf, plan, FakeDevice("1GiB"))
    assert not cpu.oom and cpu.peak_allocated_bytes == fake.peak_allocated_bytes
    # the frozen bf16 projections (8 x 64K elements at 2 bytes) become ~0.52 byte an element (the tiny model's peak
    # is set by the dequantization scratch, not its weights, so the weights are what to compare)
    nf4 = static_memory(mf, Plan(1, 1, "bf16-true", nf4_frozen_weights=True), "nf4")
    plain = static_memory(mf, Plan(1, 1, "bf16-true"), "bf16-true")
    frozen = sum(m.weight.numel() for m in frozen_linears(mf.build()))
    assert plain.weights_bytes - nf4.weights_bytes > 1.4 * frozen  # of 2 bytes an element, 1.48 saved


WEIGHTS_HEAVY = """
import torch
from torch import nn

def build_model():
    return nn.Sequential(*(nn.Linear(512, 512) for _ in range(4)))

def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, 512, device=device), torch.randn(batch_size, 512, device=device)

def loss(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()
"""


def test_an_offloaded_optimizer_is_primed_one_gradient_at_a_time_as_backward_moves_them(write_model):
    """device: cpu and fake. 4 MiB of fp32 weights, almost no activations: backward's hooks move each gradient to
    the host as it is made, so the device never holds more than one. The fake device's first-step state, made
    without that step, must not hold them all either: its peak is the cpu device's two real steps' to the byte."""
    mf = load_model_file(write_model(WEIGHTS_HEAVY))
    plan = Plan(2, 1, "fp32", offload_optimizer=True)
    cpu, fake = run_trial(mf, plan, CpuDevice("1GiB")), run_trial(mf, plan, FakeDevice("1GiB"))
    weights = 4 * (512 * 512 + 512) * 4
    print(f"offloaded AdamW, weights {weights}: peak cpu {cpu.peak_allocated_bytes}, fake {fake.peak_allocated_bytes}")
    assert cpu.peak_allocated_bytes == fake.peak_allocated_bytes < 1.5 * weights  # not weights + all gradients
    assert cpu.host_peak_bytes == fake.host_peak_bytes


def test_the_8bit_codebooks_are_real_whatever_mode_first_imports_them(monkeypatch):
    """device: fake. The 8-bit optimizer's module is imported where the lever is first used, which can be inside a
    simulated device's measurement: its codebooks are still real CPU tensors, counted by no tracker (they were fake
    ones, counted as 4 KiB of the device's, a "gradient" in a floor's breakdown, and fake for the process's life)."""
    import sys

    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    import oomtune.levers
    from oomtune.memory.tracker import MemoryTracker

    monkeypatch.delitem(sys.modules, "oomtune.levers.adamw8bit")  # restored after the test, with the attribute
    monkeypatch.delattr(oomtune.levers, "adamw8bit")
    tracker = MemoryTracker()
    with FakeTensorMode(allow_non_fake_inputs=True), tracker:
        import oomtune.levers.adamw8bit as fresh
    books = [t for pair in fresh._CODEBOOKS.values() for t in pair]
    assert len(books) == 4
    assert not any(isinstance(t, FakeTensor) for t in books) and {t.device.type for t in books} == {"cpu"}
    assert tracker.live_bytes == 0 and tracker.peak_bytes == 0

