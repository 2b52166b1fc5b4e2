"""Which 8-bit AdamW a run builds, by device and by whether the optimizer is offloaded. No GPU needed: only the
class is chosen, over CPU parameters."""

from __future__ import annotations

import contextlib
import importlib.util
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from oomtune.config.schema import Plan
from oomtune.levers import make_optimizer
from oomtune.levers.adamw8bit import BlockwiseAdamW8bit
from oomtune.levers.offload import HostOffloadOptimizer
from oomtune.model_file import load_model_file

from ..conftest import EXAMPLES

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")


@needs_torchao
def test_on_cuda_8bit_state_is_torchaos_on_the_device_and_the_stand_ins_once_offloaded_to_host():
    """Which 8-bit AdamW a cuda run builds (no GPU needed: only the class is chosen; the parameters are CPU ones and
    `host()` is a no-op): torchao's on the device; offloaded, BlockwiseAdamW8bit, eager, in host memory. torchao's
    compiled step on CPU tensors needs inductor's C++ toolchain, and on an H200 with torch 2.11 it broke the
    compiled GPU step of the next model trained in the process (make gpu-check)."""
    from torchao.optim import AdamW8bit

    cuda = SimpleNamespace(kind="cuda", pin_memory=False, host=contextlib.nullcontext)
    mf = load_model_file(EXAMPLES / "tiny_gpt.py")
    model = nn.Linear(64, 64)

    def built(plan: Plan) -> torch.optim.Optimizer:
        return make_optimizer(mf, list(model.parameters()), 1e-3, model, plan, cuda)

    assert type(built(Plan(1, 1, optimizer_8bit=True))) is AdamW8bit
    offloaded = built(Plan(1, 1, optimizer_8bit=True, offload_optimizer=True))
    assert isinstance(offloaded, HostOffloadOptimizer) and type(offloaded.inner) is BlockwiseAdamW8bit
