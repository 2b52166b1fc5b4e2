"""A backward that ran out of memory under activation checkpointing leaves nothing alive once the device is released
(memory/leftovers.py). Devices: cpu (and plain torch on the CPU, no device)."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from oomtune.config.schema import Plan
from oomtune.memory.devices import CpuDevice
from oomtune.model_file import load_model_file
from oomtune.search.trial import run_trial

from ..conftest import ROOT

FINETUNE_MODELS = ROOT / "tests" / "finetune" / "models"


class _RaiseAt(TorchDispatchMode):
    """Counts ops; raises the CUDA OOM after op number `at` (None: never)."""

    def __init__(self):
        super().__init__()
        self.ops, self.at = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        out = func(*args, **(kwargs or {}))
        if self.at is not None and self.ops == self.at:
            raise torch.cuda.OutOfMemoryError("simulated")
        return out


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) + x


def _failed_backward(at: int | None) -> tuple[weakref.ref, int, int]:
    """Two checkpointed blocks, the backward raising after op `at`: (a weak reference to the second block's weight,
    the ops of the forward, all ops)."""
    torch.manual_seed(0)
    blocks = [_Block(), _Block()]
    held = weakref.ref(blocks[1].up.weight)
    mode = _RaiseAt()
    try:
        with mode:
            x = torch.randn(4, 16, requires_grad=True)
            for block in blocks:
                x = checkpoint(block, x, use_reentrant=False)
            loss = x.sum()
            forward_ops, mode.at = mode.ops, at
            loss.backward()
    except torch.cuda.OutOfMemoryError:
        pass
    del blocks, x, loss
    gc.collect()
    return held, forward_ops, mode.ops


def test_a_failed_checkpointed_backward_lets_go_of_the_block_once_a_device_is_released():
    _, forward_ops, all_ops = _failed_backward(None)
    kept = []
    for at in range(forward_ops + 1, all_ops + 1):
        held, _, _ = _failed_backward(at)
        if held() is not None:
            kept.append(at)
        CpuDevice("1GiB").release()
        assert held() is None, f"raising after op {at}: the block's weight is still alive"
    assert kept, "no failure point kept the block alive before the drop: this test no longer tests anything"


def test_the_cpu_device_counts_nothing_after_a_checkpointed_trial_ran_out():
    """Before: 1.6-2.5 MB still counted after the trials at 70%, 75% and 95% of the peak, and the next trial's peak
    1.0 MB higher."""
    model_file = load_model_file(FINETUNE_MODELS / "hf_mistral_lora_all.py")
    plan = Plan(1, 64, "bf16", True)
    peak = run_trial(model_file, plan, CpuDevice("1GiB")).peak_bytes
    failed = 0
    for share in range(60, 100, 5):
        device = CpuDevice(f"{peak * share // 100}B")
        result = run_trial(model_file, plan, device)
        failed += result.oom
        assert device.live_bytes() == 0, f"{share}% of the peak: {device.live_bytes()} B still counted"
        assert result.oom or result.peak_bytes == peak
    assert failed
