"""The fake device's estimates against the real GPU: a card profile's peaks, a PEFT LoRA model, each lever past
accumulation. Needs CUDA (skipped with the reason without it); run with tests/test_gpu.py by `make gpu-check`."""

from __future__ import annotations

import pytest
import torch

from oomtune.config.schema import Plan
from oomtune.memory.devices import make_device
from oomtune.model_file import load_model_file
from oomtune.search.trial import run_trial

from .conftest import EXAMPLES, run_cli

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

MiB = 1 << 20


def test_a_peft_lora_model_probes_trains_and_its_fake_estimate_is_close(tmp_path):
    """A PEFT LoRA Hugging Face Llama (tests/finetune/models) on the GPU: the probe finds a plan, it trains 3 steps,
    and the fake device's tensor peak for that plan is near the GPU's allocated peak (the GPU adds cuBLAS
    workspaces and allocator blocks; make gpu-check prints both)."""
    for module in ("transformers", "peft", "yaml"):
        pytest.importorskip(module)
    from pathlib import Path

    from oomtune.memory.breakdown import breakdown
    from oomtune.memory.devices import FakeDevice
    from oomtune.memory.margin import Margin

    model = Path(__file__).parent / "finetune" / "models" / "hf_llama_lora.py"
    r = run_cli("probe", model, "--device", "cuda", "--budget", "4GiB", "--batch", "16", "--context", "256",
                "--out", tmp_path / "best.yaml", "--json")
    assert r.exit_code == 0, r.output
    t = run_cli("train", "--config", tmp_path / "best.yaml", "--device", "cuda", "--steps", "3",
                "--run-dir", tmp_path / "run")
    assert t.exit_code == 0, t.output
    mf = load_model_file(model)
    from oomtune.config.loading import load_config

    plan = load_config(tmp_path / "best.yaml").plan
    real, before = measured_trial(mf, plan)
    fake = breakdown(mf, plan, FakeDevice("4GiB", gpu=this_card(), margin=Margin()))
    print(f"LoRA Llama {plan.describe()}: cuda allocated peak {real} (+{before} live before), fake tensor peak "
          f"{fake.tensor_peak_bytes}")
    assert 0.9 * fake.tensor_peak_bytes <= real <= 1.5 * fake.tensor_peak_bytes + 16 * MiB


def measured_trial(mf, plan) -> tuple[int, int]:
    """(the trial's allocated peak above what was live before it, what was live before it) on the GPU, after one
    warm-up trial: the cuBLAS workspaces (2 x 32 MiB on Hopper) and whatever earlier tests left are not the
    trial's, and a fake trial does not count them as tensors."""
    cuda = make_device("cuda", "4GiB")
    run_trial(mf, plan, cuda)
    before = cuda.live_bytes()
    real = run_trial(mf, plan, cuda)
    assert not real.oom, real.oom_message
    return real.peak_allocated_bytes - before, before


def this_card():
    """The card profile of the GPU these tests run on (the table's entry, or one made from what the driver says)."""
    import torch

    from oomtune.memory.cards import card_for

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return card_for(props.name, props.total_memory, (props.major, props.minor))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_the_card_profile_predicts_this_cards_peaks(precision):
    """The fake device with this card's profile (CUDA autocast, its SDPA kernel, the caching allocator model seeded
    with the predicted cuBLAS workspaces) against the real trial: tensors against max allocated (less what was live
    before), the allocator model against max reserved. Prints all four for make gpu-check's note."""
    from oomtune.memory.devices import FakeDevice

    mf = load_model_file(EXAMPLES / "tiny_gpt.py")
    plan = Plan(16, 256, precision)
    cuda = make_device("cuda", "4GiB")
    run_trial(mf, plan, cuda)  # the workspaces exist from here on, as in any training process
    before = cuda.live_bytes()
    real = run_trial(mf, plan, cuda)
    fake = run_trial(mf, plan, FakeDevice("4GiB", gpu=this_card()))
    own = real.peak_allocated_bytes - before
    print(f"{precision} {plan.describe()}: real allocated {own} (+{before} live before), reserved {real.peak_bytes}; "
          f"fake tensors {fake.peak_allocated_bytes}, modelled reserved {fake.modelled_reserved_bytes} "
          f"({this_card().workspace_bytes} of it the predicted workspaces)")
    assert fake.peak_allocated_bytes == pytest.approx(own, rel=0.1)
    assert fake.modelled_reserved_bytes == pytest.approx(real.peak_bytes, rel=0.2)


LEVER_PLANS = {  # the rungs past accumulation, on the tiny GPT (NF4: tests/levers/models' LoRA Llama)
    # first: its 8-bit step runs on host tensors; when that was torchao's compiled one, the compiled GPU step of
    # the next model ("8bit" below) failed to compile (make gpu-check on an H200)
    "8bit-offload": ("tiny_gpt", {"optimizer_8bit": True, "offload_optimizer": True, "grad_accum_steps": 2}),
    "bf16-true": ("tiny_gpt", {"precision": "bf16-true", "activation_checkpointing": True}),
    "8bit": ("tiny_gpt", {"optimizer_8bit": True}),
    "offload": ("tiny_gpt", {"offload_optimizer": True, "grad_accum_steps": 2}),
    "offload-activations": ("tiny_gpt", {"offload_activations": True}),
    "nf4": ("qlora", {"precision": "bf16-true", "nf4_frozen_weights": True, "activation_checkpointing": True}),
    # a Hugging Face causal LM's loss in slices (the same LoRA Llama, without NF4)
    "chunked-loss": ("qlora", {"precision": "bf16", "chunked_loss": True}),
    # the forward's saved tensors on the host, the slices' output layer and loss keeping theirs on the card
    "chunked-loss+offload-activations": ("qlora", {"precision": "bf16", "chunked_loss": True,
                                                   "offload_activations": True, "activation_checkpointing": True}),
    # the optimizer stepped in backward (fused AdamW, one parameter a hook), the whole batch at once
    "step-in-backward": ("tiny_gpt", {"precision": "bf16-true", "optimizer_in_backward": True}),
    # each block and the loss torch.compile'd (inductor) on cuda, traced by AOTAutograd on fake
    "compile": ("qlora", {"precision": "bf16-true", "chunked_loss": True, "compile": True}),
    # the model file's own torch.compile(model): inductor's whole graph on cuda, traced per block on fake
    "own-compile": ("compiled", {"precision": "bf16-true"}),
    # the model file's BitsAndBytesConfig (NF4, double-quantized): bitsandbytes' CUDA kernels on the card
    "bnb-nf4": ("bnb_qlora", {"precision": "bf16-true", "activation_checkpointing": True}),
}


@pytest.mark.parametrize("lever", LEVER_PLANS)
def test_each_lever_runs_on_cuda_and_the_fake_estimate_is_close(lever, tmp_path):
    """Each lever on the GPU with the library's own code (torchao's AdamW8bit and NF4; pinned host memory): the
    trial runs, and the fake device's tensor peak (with the cpu stand-ins) is near the GPU's allocated peak.
    Prints both, and the host memory each side counted, for make gpu-check's note."""
    from pathlib import Path

    from oomtune.memory.devices import FakeDevice
    from oomtune.memory.margin import Margin

    name, keys = LEVER_PLANS[lever]
    offload = "offload" in lever
    if lever in ("8bit", "nf4"):
        pytest.importorskip("torchao")
    if lever == "bnb-nf4":
        pytest.importorskip("bitsandbytes")
    if name in ("qlora", "compiled", "bnb_qlora"):
        pytest.importorskip("peft")
        mf = load_model_file(Path(__file__).parent / "levers" / "models" / f"hf_llama_{name}.py")
    else:
        mf = load_model_file(EXAMPLES / "tiny_gpt.py")
    plan = Plan(8, 128, **keys)
    cuda = make_device("cuda", "4GiB")
    run_trial(mf, plan, cuda)  # warm-up: the workspaces (and a compiled optimizer step's kernels) exist from here on
    before = cuda.live_bytes()
    real = run_trial(mf, plan, cuda)
    fake = run_trial(mf, plan, FakeDevice("4GiB", gpu=this_card(), margin=Margin()))
    own = real.peak_allocated_bytes - before
    print(f"{lever} ({plan.describe()}): cuda allocated peak {own} (+{before} live before), host "
          f"{real.host_peak_bytes}; fake tensor peak {fake.peak_allocated_bytes}, host {fake.host_peak_bytes}")
    assert not real.oom, real.oom_message
    assert 0.8 * fake.peak_allocated_bytes <= own <= 1.5 * fake.peak_allocated_bytes + 16 * MiB
    # host memory: the offloaded state, and NF4's build (in host memory, quantized there before it moves)
    assert (real.host_peak_bytes > 0) == (fake.host_peak_bytes > 0) == (offload or "nf4" in lever)
