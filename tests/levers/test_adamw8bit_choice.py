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


def test_a_checkpoint_names_the_optimizer_an_offloaded_one_runs_and_refuses_another_ones_state():
    """The checkpoint's optimizer_class names the host optimizer inside the offload one: a run whose offloaded step
    was torchao's (before the stand-in ran there on cuda) holds torchao's state, which the stand-in cannot read.
    A checkpoint from before the inner name was recorded ("HostOffloadOptimizer") is still taken."""
    from oomtune.train.checkpointer import optimizer_class, optimizer_mismatch

    cpu = SimpleNamespace(kind="cpu", pin_memory=False, host=contextlib.nullcontext)
    model = nn.Linear(64, 64)
    offloaded = make_optimizer(load_model_file(EXAMPLES / "tiny_gpt.py"), list(model.parameters()), 1e-3, model,
                               Plan(1, 1, optimizer_8bit=True, offload_optimizer=True), cpu)
    assert optimizer_class(offloaded) == "HostOffloadOptimizer(BlockwiseAdamW8bit)"
    assert optimizer_class(torch.optim.AdamW(model.parameters())) == "AdamW"
    assert optimizer_mismatch({"optimizer_class": "HostOffloadOptimizer(AdamW8bit)"}, offloaded) == \
        "it was written by HostOffloadOptimizer(AdamW8bit), this run builds HostOffloadOptimizer(BlockwiseAdamW8bit)"
    for same in ("HostOffloadOptimizer(BlockwiseAdamW8bit)", "HostOffloadOptimizer"):
        assert optimizer_mismatch({"optimizer_class": same}, offloaded) is None


def test_an_offloaded_8bit_plan_needs_no_library_on_cuda(monkeypatch):
    """Offloaded, the 8-bit step is the stand-in's, so a cuda plan with both levers runs without torchao or
    bitsandbytes; on the device, 8-bit AdamW still names the extra that brings one."""
    import oomtune.levers as levers
    from oomtune.errors import OomtuneError

    monkeypatch.setattr(levers, "installed", lambda name: False)
    levers.check_plan_runs(Plan(1, 1, optimizer_8bit=True, offload_optimizer=True), "cuda")
    with pytest.raises(OomtuneError, match="8-bit AdamW on cuda needs torchao or bitsandbytes"):
        levers.check_plan_runs(Plan(1, 1, optimizer_8bit=True), "cuda")
