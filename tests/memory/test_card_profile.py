"""A card profile (--gpu) on the simulated devices: cpu and fake account like that CUDA card, and agree to the byte.
Devices: cpu and fake."""

import pytest

from oomtune.config.schema import Plan
from oomtune.errors import OomtuneError
from oomtune.memory.cards import GENERIC, MiB, card_for, cublas_workspace_bytes, find_gpu
from oomtune.memory.devices import CpuDevice, FakeDevice
from oomtune.memory.margin import CardMargin, Margin, parse_margin
from oomtune.model_file import load_model_file
from oomtune.search.trial import run_trial

from ..conftest import EXAMPLES

H100, T4 = find_gpu("h100"), find_gpu("t4")
PLANS = {"fp32": Plan(2, 32, "fp32"), "fp16": Plan(2, 32, "fp16"),
         "fp16+ckpt": Plan(2, 32, "fp16", activation_checkpointing=True)}


@pytest.fixture(scope="module")
def tiny():
    return load_model_file(EXAMPLES / "tiny_gpt.py")


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("card", ["h100", "t4"])
def test_cpu_and_fake_with_a_card_agree_to_the_byte(tiny, card, plan):
    spec = find_gpu(card)
    cpu = run_trial(tiny, PLANS[plan], CpuDevice("4GiB", card=spec))
    fake = run_trial(tiny, PLANS[plan], FakeDevice("4GiB", gpu=spec))
    assert not cpu.oom and not fake.oom
    assert (fake.peak_bytes, fake.peak_allocated_bytes, fake.modelled_reserved_bytes) == \
        (cpu.peak_bytes, cpu.peak_allocated_bytes, cpu.modelled_reserved_bytes)
    # the peak is the card's: its CUDA context plus what its caching allocator reserves, workspaces included
    assert cpu.peak_bytes == spec.context + cpu.modelled_reserved_bytes
    assert cpu.modelled_reserved_bytes >= cpu.peak_allocated_bytes + spec.workspace_bytes


ATTENTION = """
import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(64, 192), nn.Linear(64, 64)

    def forward(self, x, y):
        b, t, _ = x.shape
        q, k, v = (z.transpose(1, 2) for z in self.qkv(x).view(b, t, 3, 4, 16).unbind(2))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, 64)
        return F.mse_loss(self.out(a).float(), y)


def build_model():
    return Net()


def make_batch(batch_size, context_length, device):
    return (torch.randn(batch_size, context_length, 64, device=device),
            torch.randn(batch_size, context_length, 64, device=device))
"""


def test_the_card_decides_the_attention_kernel_and_so_the_saved_activations(write_model):
    """bf16 on an H100 runs flash attention, which keeps the output and a logsumexp; a T4 has neither flash nor
    bf16 in its efficient kernel, so the math backend runs, and keeps the (B, H, T, T) softmax (in fp32)."""
    mf = load_model_file(write_model(ATTENTION))
    b, t = 2, 256
    plan = Plan(b, t, "bf16")
    peak = {name: run_trial(mf, plan, CpuDevice("4GiB", card=card, margin=Margin())).peak_allocated_bytes
            for name, card in (("h100", H100), ("t4", T4))}
    assert peak["t4"] - peak["h100"] >= b * 4 * t * t * 4


def test_the_allocator_model_runs_out_where_the_tensors_alone_would_fit(tiny):
    """A budget the tensors fit in, but not the card's context + the reserved blocks: out of memory, as on the card."""
    plan = PLANS["fp32"]
    ok = run_trial(tiny, plan, FakeDevice("4GiB", gpu=H100))
    tensors_only = H100.context + H100.workspace_bytes + ok.peak_allocated_bytes
    assert tensors_only < ok.peak_bytes  # the allocator's rounding and segments cost something
    tight = run_trial(tiny, plan, FakeDevice(str(tensors_only), gpu=H100))
    assert tight.oom and "caching allocator (as modelled)" in tight.oom_message
    assert not run_trial(tiny, plan, FakeDevice(str(ok.peak_bytes), gpu=H100)).oom


def test_pytorchs_default_cublas_workspace_per_compute_capability():
    assert cublas_workspace_bytes((9, 0)) == cublas_workspace_bytes((12, 0)) == 32 * MiB
    assert cublas_workspace_bytes((8, 0)) == cublas_workspace_bytes((7, 5)) == 8 * MiB + 128 * 1024
    assert H100.workspace_bytes == 2 * 32 * MiB  # one per handle: the forward's thread, the backward's


def test_a_card_margin_is_recorded_and_read_back():
    m = CardMargin(H100)
    assert m.describe() == "card:h100" and parse_margin("card:h100") == m
    assert m.fixed_lines() == {"context": H100.context, "workspaces": H100.workspace_bytes}
    assert m.overhead(100, reserved_bytes=100 + H100.workspace_bytes + 4096) == H100.context + H100.workspace_bytes \
        + 4096
    assert "assumed" in m.text()  # not measured on an H100 yet: the estimate says so
    assert "assumed" not in CardMargin(find_gpu("h200")).text()  # measured by make gpu-check on an H200
    assert find_gpu("h200").context == 802750464


def test_a_flat_margin_still_overrides_and_the_card_still_decides_kernels(tiny):
    plan = PLANS["fp16"]
    flat = run_trial(tiny, plan, FakeDevice("4GiB", gpu=T4, margin=Margin()))
    assert flat.peak_bytes == flat.peak_allocated_bytes
    carded = run_trial(tiny, plan, FakeDevice("4GiB", gpu=T4))
    assert carded.peak_allocated_bytes == flat.peak_allocated_bytes and carded.peak_bytes > flat.peak_bytes


def test_the_generic_card_needs_a_budget_and_says_what_it_is():
    with pytest.raises(Exception, match="--budget"):
        FakeDevice(gpu=GENERIC)
    dev = FakeDevice("24GiB", gpu=GENERIC)
    assert dev.card_text() == "a generic sm80 card (sm80)" and dev.supports_bf16()


def test_a_budget_too_small_for_the_context_and_the_workspaces_segments_is_one_line():
    """The T4's two 8.125 MiB workspaces take a 20 MiB segment: a budget that holds their bytes but not the segment
    is refused when the device is made, not by an error from inside the allocator model."""
    from oomtune.errors import OomtuneError

    with pytest.raises(OomtuneError, match="give a larger --budget"):
        CpuDevice(str(T4.context + 20 * MiB), card=T4)
    assert CpuDevice(str(T4.context + 20 * MiB + 512), card=T4).tracker.budget_bytes == 512


def test_a_card_margin_names_the_card_or_agrees_with_it():
    from oomtune.errors import OomtuneError

    dev = CpuDevice("1GiB", margin=CardMargin(T4))
    assert dev.card == T4 and dev.margin.card == T4
    with pytest.raises(OomtuneError, match="another card's margin"):
        FakeDevice("1GiB", gpu=T4, margin=CardMargin(H100))


def test_with_a_card_the_cpu_devices_budget_is_the_cards_memory():
    assert CpuDevice(card=T4).budget_bytes == FakeDevice(gpu=T4).budget_bytes == T4.memory_bytes
    assert CpuDevice("50%", card=T4).budget_bytes == T4.memory_bytes // 2


@pytest.mark.parametrize(("driver", "mib", "cc", "table"), [
    ("NVIDIA H200", 143771, (9, 0), "h200"),  # the table's name
    ("NVIDIA A100-SXM4-80GB", 81920, (8, 0), "a100-80"),  # a variant's long name: model, memory, capability
    ("NVIDIA A100-PCIE-40GB", 40536, (8, 0), "a100-40"),  # ECC on: a few hundred MiB less
    ("NVIDIA H100 80GB HBM3", 81559, (9, 0), "h100"),
    ("NVIDIA GeForce RTX 4090", 24564, (8, 9), "rtx4090"),
    ("NVIDIA A100", 81920, (8, 0), "a100-80"),  # the bare model name: its memory says which
    ("NVIDIA H100 NVL", 95830, (9, 0), None),  # another card of that model: its own memory
    ("NVIDIA A100-SXM4-80GB", 81920, (9, 0), None),  # not the table's capability
    ("NVIDIA RTX A6000", 49140, (8, 6), "a6000"),
    ("Tesla V100-SXM2-32GB", 32510, (7, 0), "v100-32"),
    ("Tesla V100-PCIE-16GB", 16160, (7, 0), "v100-16"),
    ("NVIDIA RTX A4000", 16376, (8, 6), None),  # not in the table
])
def test_the_driver_names_a_table_card_by_its_model_memory_and_capability(driver, mib, cc, table):
    """device: none. The card a CUDA device reports (cuda.py) is the table's where its name, or its model with the
    same compute capability and memory within 3%, says so; else a card made from what the driver reports."""
    spec = card_for(driver, mib * MiB, cc)
    if table is None:
        assert (spec.name, spec.memory_bytes, spec.compute_capability) == (driver, mib * MiB, cc)
    else:
        assert spec is find_gpu(table)


def test_a_model_name_sold_in_two_memory_sizes_is_refused_naming_both():
    """device: none. --gpu a100 could be 40 or 80 GB, which changes every estimate: the user says which."""
    with pytest.raises(OomtuneError, match=r"a100-40 \(40 GB\) or a100-80 \(80 GB\)"):
        find_gpu("A100")
    assert find_gpu("a100-40").memory_bytes == 40960 * MiB


@pytest.mark.parametrize("driver, table", [
    ("NVIDIA A100-SXM4-80GB", "a100-80"),
    ("NVIDIA A100-PCIE-40GB", "a100-40"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("Tesla V100-SXM2-16GB", "v100-16"),
    ("Tesla V100-PCIE-32GB", "v100-32"),
    ("NVIDIA GeForce RTX 4090", "rtx4090"),
])
def test_gpu_finds_a_card_by_the_name_nvidia_smi_prints(driver, table):
    """device: none. docs/estimate.md: "The driver's names ... find a card too". --gpu refused the names nvidia-smi
    prints for the A100, H100 and V100 variants ("not in the table"), though each names its memory."""
    assert find_gpu(driver) is find_gpu(table)


def test_gpu_keeps_refusing_another_card_of_a_table_model():
    """device: none. An H100 NVL (94 GB) is not the table's H100 80GB; an A100 of unknown memory stays ambiguous."""
    with pytest.raises(OomtuneError, match="not in the table"):
        find_gpu("NVIDIA H100 NVL")
    with pytest.raises(OomtuneError, match="more than one card"):
        find_gpu("NVIDIA A100")
    with pytest.raises(OomtuneError, match="not in the table"):
        find_gpu("NVIDIA RTX A4000")
