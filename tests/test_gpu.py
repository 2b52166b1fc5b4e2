"""The cuda device on a real GPU: OOMs caught and cleaned up in every phase, the budget, the probe's boundary.

Every test here needs CUDA and is skipped (with the reason) without it. Sizes are chosen so the module runs in
a couple of minutes on one large GPU (written for an H200; any GPU with ~12 GiB free runs it). Run:
`python -m pytest -m gpu tests/test_gpu.py` (or `make gpu-check`, which also prints the fake-vs-real table).
"""

from __future__ import annotations

import gc
import importlib.util
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from oomtune.config.schema import Plan
from oomtune.errors import OomtuneError
from oomtune.memory.cuda import CudaDevice
from oomtune.memory.devices import make_device
from oomtune.model_file import load_model_file
from oomtune.search.options import Targets
from oomtune.search.probe import probe
from oomtune.search.trial import run_trial

from .conftest import EXAMPLES, run_cli

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

GiB, MiB = 1 << 30, 1 << 20

# One 16384 x 16384 fp32 weight: 1 GiB of parameters, 1 GiB of gradient (allocated in backward), 2 GiB of
# AdamW moments (allocated in the optimizer step); a micro-batch of 8 rows costs only 512 KiB.
BIG_LINEAR = """
import torch
from torch import nn

N = 16384

def build_model():
    return nn.Linear(N, N, bias=False)

def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, N, device=device)

def loss(model, batch):
    return model(batch).pow(2).mean()
"""

# Tiny weights (8 MiB), huge activations: each example's 1024 features become a 1024 x 1024 outer product,
# 4 MiB an example, so micro-batch 512 asks for 2 GiB in the forward pass.
WIDE = """
import torch
from torch import nn

D = 1024

class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)

    def forward(self, x):  # (B, D)
        h = self.a(x)
        outer = h.unsqueeze(2) * h.unsqueeze(1)  # (B, D, D)
        return self.b(outer).mean()

def build_model():
    return Outer()

def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, D, device=device)
"""

# phase -> (model, budget, micro-batch, the phases the step started before it ran out of memory)
OOM_CASES = {
    "forward": ("wide", "1GiB", 512, ["forward"]),  # a 2 GiB activation under a 1 GiB cap
    "backward": ("big_linear", "1.5GiB", 8, ["forward", "backward"]),  # weight 1 + gradient 1 > 1.5 GiB
    "optimizer": ("big_linear", "2.5GiB", 8, ["forward", "backward", "optimizer"]),  # + AdamW 2 GiB > 2.5
}
FITS = {"wide": ("8GiB", 16), "big_linear": ("8GiB", 8)}  # the same models where they fit (peak ~5 GiB)


@pytest.fixture(autouse=True)
def uncapped_after():
    """Each test sets its own cap (by making a CudaDevice); none leaks into the next."""
    yield
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu_models")
    files = {}
    for name, source in (("big_linear", BIG_LINEAR), ("wide", WIDE)):
        (d / f"{name}.py").write_text(textwrap.dedent(source))
        files[name] = load_model_file(d / f"{name}.py")
    return files


@pytest.fixture(scope="module")
def baseline(models):
    """memory_allocated once every kind of work has run once: what lives across trials (cuBLAS workspaces,
    allocated through the caching allocator on first use) is in it, so a leak shows as a difference."""
    for name, (budget, batch) in FITS.items():
        r = run_trial(models[name], Plan(batch, 1), make_device("cuda", budget), steps=2)
        assert not r.oom, f"warm-up {name} ran out of memory under {budget}: {r.oom_message}"
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0)
    return torch.cuda.memory_allocated()


def record_phases(device) -> list[str]:
    """The phases the training step announces (via device.mark) as it enters them."""
    seen: list[str] = []
    mark = device.mark

    def recording_mark(reading, phase):
        if phase is not None:
            seen.append(phase)
        mark(reading, phase)

    device.mark = recording_mark
    return seen


def oom_trial(models, phase: str):
    name, budget, batch, _ = OOM_CASES[phase]
    device = make_device("cuda", budget)
    phases = record_phases(device)
    return run_trial(models[name], Plan(batch, 1), device, steps=1), phases


# -- OOM in each phase of the step ---------------------------------------------------------------

@pytest.mark.parametrize("phase", list(OOM_CASES))
def test_an_oom_in_each_phase_is_caught_and_cleaned_up(models, baseline, phase):
    name, budget, _, expected_phases = OOM_CASES[phase]
    assert torch.cuda.memory_allocated() == baseline
    r, phases = oom_trial(models, phase)
    assert r.oom, f"{name} under {budget} did not run out of memory"
    assert phases == expected_phases  # it ran out in `phase`, not before and not after
    assert r.oom_message.startswith("CUDA out of memory") and "Simulated" not in r.oom_message  # the allocator's
    assert torch.cuda.memory_allocated() == baseline  # the failed step's tensors are all gone
    # and the GPU is usable: the same model trains where it fits
    fit_budget, fit_batch = FITS[name]
    assert not run_trial(models[name], Plan(fit_batch, 1), make_device("cuda", fit_budget), steps=1).oom


def test_twenty_ooms_in_a_row_leave_memory_allocated_at_its_baseline(models, baseline):
    phases = list(OOM_CASES)
    after = []
    for i in range(20):
        phase = phases[i % 3]
        r, seen = oom_trial(models, phase)
        assert r.oom and seen == OOM_CASES[phase][3], (i, phase, seen)
        after.append(torch.cuda.memory_allocated())
    assert after == [baseline] * 20


# -- the budget ----------------------------------------------------------------------------------

def test_a_budget_caps_the_caching_allocator():
    device = CudaDevice("2GiB")
    if hasattr(torch.cuda, "get_per_process_memory_fraction"):  # newer torch: a fraction of totalGlobalMem
        props = torch.cuda.get_device_properties(device.torch_device)
        allowed = torch.cuda.get_per_process_memory_fraction(device.torch_device) * props.total_memory
        assert 0.99 * 2 * GiB <= allowed <= 2 * GiB + 1  # the cap is the budget, never above it
    ok = torch.empty(GiB, dtype=torch.uint8, device=device.torch_device)  # 1 GiB fits under 2
    with pytest.raises(torch.cuda.OutOfMemoryError, match="CUDA out of memory"):
        torch.empty(3 * GiB // 2, dtype=torch.uint8, device=device.torch_device)  # 1 + 1.5 > 2 GiB
    del ok


def test_a_budget_above_the_free_memory_is_refused():
    free = CudaDevice().free_bytes
    with pytest.raises(OomtuneError, match="is more than the .* free on"):
        CudaDevice(f"{free + GiB}B")


def test_the_default_budget_is_the_free_memory_and_respects_other_processes():
    """Another process holding 4 GiB on the same GPU lowers the default budget by that much (plus its
    CUDA context), the way NVML (and nvidia-smi) see it."""
    before = CudaDevice()
    expected_source = "nvml" if nvml_usable() else "cudaMemGetInfo"
    assert before.free_source == expected_source  # with NVML: it found its own GPU by PCI address / UUID
    cuda_free, total = torch.cuda.mem_get_info(before.torch_device)
    assert abs(before.budget_bytes - (cuda_free + torch.cuda.memory_reserved(before.torch_device))) < 0.02 * total
    hog = subprocess.Popen(
        [sys.executable, "-c", "import sys, torch; x = torch.empty(4 << 30, dtype=torch.uint8, device='cuda'); "
                               "torch.cuda.synchronize(); print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout.readline().strip() == "ready"
        during = CudaDevice()
    finally:
        hog.stdin.close()
        hog.wait(timeout=60)
    taken = before.budget_bytes - during.budget_bytes
    assert 4 * GiB <= taken <= 4 * GiB + GiB, f"another process took {taken / GiB:.2f} GiB of the budget"


def nvml_usable() -> bool:
    """pynvml imports and NVML answers (a container may have the module but not the driver's library)."""
    from oomtune.memory import nvml

    return importlib.util.find_spec("pynvml") is not None and nvml.query(processes=False).available


def nvml_gpu_of(device):
    """NVML's view of the GPU behind a CudaDevice, matched by PCI address / UUID (as the device does); skips the
    test, with NVML's reason, where NVML cannot be used here."""
    from oomtune.memory import nvml

    report = nvml.query(processes=False)
    if not report.available:
        pytest.skip(f"NVML cannot be used here: {report.reason}")
    props = torch.cuda.get_device_properties(device.torch_device)
    pci, uuid = nvml.ids_of(props)
    return nvml.find_gpu(report, pci=pci, uuid=uuid)


def test_bf16_support_matches_the_compute_capability_nvml_reports():
    pytest.importorskip("pynvml")
    device = CudaDevice()
    props = torch.cuda.get_device_properties(device.torch_device)
    gpu = nvml_gpu_of(device)
    assert gpu is not None, "NVML does not list the GPU torch is using"
    assert gpu.compute_capability == (props.major, props.minor)
    assert gpu.bf16 == device.supports_bf16()
    assert abs(gpu.total_bytes - props.total_memory) < 0.05 * props.total_memory


def test_oomtune_gpus_lists_this_gpu():
    for module in ("typer", "rich", "yaml", "pynvml"):  # the CLI's dependencies; gpu-check may run without them
        pytest.importorskip(module)
    import json

    gpu = nvml_gpu_of(CudaDevice())
    assert gpu is not None, "NVML does not list the GPU torch is using"
    r = run_cli("gpus", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["available"] and data["driver_version"] and data["cuda_driver_version"]
    listed = {g["uuid"]: g for g in data["gpus"]}
    assert listed[gpu.uuid]["name"] == gpu.name and listed[gpu.uuid]["total_bytes"] == gpu.total_bytes


# -- the probe's boundary is a real OOM, and its plan trains -------------------------------------

CAP = "8GiB"
B, T = 8192, 512  # more than any rung of tiny_gpt holds under 8 GiB: every rung is searched, accumulation added


@pytest.fixture(scope="module")
def capped_probe():
    """tiny_gpt probed under an 8 GiB cap with headroom 0, so "does not fit" can only mean a real OOM."""
    mf = load_model_file(EXAMPLES / "tiny_gpt.py")
    result = probe(mf, make_device("cuda", CAP), Targets(B, T, T), headroom=0.0)
    assert result.config is not None, result.why_nothing_fits
    return mf, result


def test_the_probes_boundary_under_an_8gib_cap_is_a_real_oom(capped_probe):
    mf, result = capped_probe
    choice = result.ladder.choice
    rung = next(r for r in result.ladder.rungs if r.rung == choice.rung)
    b_s = rung.micro_batch_size
    assert rung.context_length == T and b_s < B, "the cap did not bind: raise B"

    # the rung's boundary as the search certified it: b fits, and the next size it tried does not (b + 1 without
    # the prior; with it, where accumulation will be used, the next divisor of B, at that divisor's accumulation)
    tried = [r for r in result.records if r.rung == choice.rung.name and r.context_length == T]
    fits = [r for r in tried if r.result == "fits"]
    assert max(r.micro_batch_size for r in fits) == b_s
    at_rec = next(r for r in fits if r.micro_batch_size == b_s)
    over_rec = min((r for r in tried if r.result == "oom" and r.micro_batch_size > b_s),
                   key=lambda r: r.micro_batch_size)
    assert over_rec.micro_batch_size in (b_s + 1, next(d for d in range(b_s + 1, B + 1) if B % d == 0))

    # the boundary holds on a fresh pair of trials under the same cap
    device = make_device("cuda", CAP)
    prec, ckpt = choice.rung.precision, choice.rung.activation_checkpointing
    at = run_trial(mf, Plan(b_s, T, prec, ckpt, at_rec.grad_accum_steps), device)
    over = run_trial(mf, Plan(over_rec.micro_batch_size, T, prec, ckpt, over_rec.grad_accum_steps), device)
    assert not at.oom, at.oom_message
    assert over.oom and over.oom_message.startswith("CUDA out of memory")


def test_the_probes_plan_trains_50_steps_under_the_same_cap_without_an_oom(capped_probe, tmp_path):
    pytest.importorskip("yaml")  # the config file
    from oomtune.config.writing import save_config
    from oomtune.train.trainer import train

    _, result = capped_probe
    plan = result.config.plan
    assert plan.global_batch_size == B
    path = tmp_path / "best.yaml"
    save_config(result.config, path)
    run = train(path, device="cuda", budget=CAP, overrides={
        "steps": 50, "warmup_steps": 5, "log_every_n_steps": 1, "run_dir": str(tmp_path / "run")})
    assert run.step == 50 and not run.interrupted
    assert run.fallbacks == () and run.plan == plan  # no OOM: the trainer never had to cut the plan
    assert math.isfinite(run.last_loss) and run.last_loss < run.first_loss  # tiny_gpt trains on real text
