"""A model file written for a GPU on the simulated devices (memory/on_host.py): its own `torch.autocast("cuda")`
regions are the cpu's autocast there, as its `.to("cuda")` tensors are the cpu's. Devices: cpu and fake."""

from __future__ import annotations

import pytest
import torch

from oomtune.config.schema import Plan
from oomtune.memory.devices import CpuDevice, FakeDevice
from oomtune.memory.margin import Margin
from oomtune.model_file import load_model_file
from oomtune.search.trial import run_trial

OWN_AUTOCAST = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))

    def forward(self, x):
        with REGION:
            for layer in self.layers:
                y = layer(x)
                x = x + torch.tanh(y)
            self.inside = y.dtype
        return x.float().square().mean()

def build_model():
    return Net().to("cuda")

def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, context_length, 64, device=device)

def loss(model, batch):
    return model(batch)
"""


@pytest.mark.parametrize("region, precision, inside", [
    ('torch.autocast("cuda", enabled=False)', "bf16", torch.float32),  # kept in fp32 under a bf16 plan
    ('torch.autocast(device_type="cuda", dtype=torch.bfloat16)', "fp32", torch.bfloat16),  # its own bf16 region
    ("torch.cuda.amp.autocast()", "fp32", torch.float16),  # CUDA's default dtype
])
def test_a_model_files_own_cuda_autocast_is_the_simulated_devices(write_model, region, precision, inside):
    """Torch disabled a "cuda" autocast region on the cpu (no CUDA): a GPU file's fp32 region ran in the plan's bf16
    (its saved activations half of what the card holds: the estimate too low) and its own bf16 region in fp32.
    The same file written with the tensors' own device type is what the card would do: same peaks in forward,
    backward and the optimizer step, to the byte, on the cpu and on fake tensors."""
    if region.startswith("torch.cuda.amp") and not hasattr(torch.cuda.amp, "autocast"):
        pytest.skip("this torch has no torch.cuda.amp.autocast")
    plan = Plan(4, 16, precision)
    cuda = load_model_file(write_model(OWN_AUTOCAST.replace("REGION", region), "cuda_region.py"))
    same = region.replace('"cuda"', "x.device.type").replace("torch.cuda.amp.autocast()",
                                                             "torch.autocast(x.device.type, torch.float16)")
    portable = load_model_file(write_model(OWN_AUTOCAST.replace("REGION", same), "portable.py"))
    peaks = {}
    for name, model_file in (("cuda", cuda), ("portable", portable)):
        for device in (CpuDevice("1GiB"), FakeDevice("1GiB", margin=Margin())):
            seen: list = []

            def observe(t, phase, seen=seen):
                if phase == "end":
                    seen.append(t.module.inside)

            r = run_trial(model_file, plan, device, observe=observe)
            assert not r.oom and seen[-1] == inside
            peaks[name, device.kind] = {k: v for k, v in r.phase_peaks.items() if k != "setup"}  # (fake: primed)
    assert peaks["cuda", "cpu"] == peaks["portable", "cpu"] == peaks["cuda", "fake"] == peaks["portable", "fake"]
