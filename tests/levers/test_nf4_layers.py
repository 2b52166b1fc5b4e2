"""Which frozen layers the NF4 lever stores in 4 bits (levers/nf4.py): nn.Linear's own forward (F.linear, which
torchao's NF4 weight dispatches) and transformers' Conv1D, not a Linear subclass with a forward of its own.
devices: cpu and fake."""

from __future__ import annotations

import importlib.util

import pytest
from torch import nn

from oomtune.config.schema import Plan
from oomtune.errors import OomtuneError
from oomtune.levers.nf4 import frozen_linears
from oomtune.memory.devices import CpuDevice, FakeDevice
from oomtune.memory.made_nf4 import is_nf4
from oomtune.model_file import load_model_file
from oomtune.search.options import LEVERS, resolve_targets
from oomtune.search.probe import probe
from oomtune.search.trial import run_trial

from ..conftest import ROOT

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
needs_hf = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs transformers and peft")

OWN_FORWARD = '''
import torch
from torch import nn

class Transposing(nn.Linear):  # as transformers' FalconLinear computes it
    def forward(self, x):
        return x @ self.weight.T

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.plain = nn.Linear(128, 128, bias=False)
        self.own = Transposing(128, 128, bias=False)
        self.adapter = nn.Linear(128, 128, bias=False)
        for p in (*self.plain.parameters(), *self.own.parameters()):
            p.requires_grad_(False)

    def forward(self, x):
        return (self.own(self.plain(x)) + self.adapter(x)).pow(2).mean()

def build_model():
    return Net()

def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, 128, device=device)
'''


@needs_torchao
def test_a_linear_subclass_with_its_own_forward_keeps_its_weight_beside_a_plain_one_in_nf4(write_model):
    """Quantized, the subclass's x @ W.T failed on the NF4 weight ("NF4Tensor dispatch: attempting to run
    aten.permute.default"), blamed on the model file. Now the plain Linear alone is stored in NF4, and the plan runs
    on both devices, to the same peak."""
    mf = load_model_file(write_model(OWN_FORWARD))
    model = mf.build()
    assert frozen_linears(model) == [model.plain]
    plan = Plan(2, 1, "bf16-true", nf4_frozen_weights=True)
    cpu, fake = run_trial(mf, plan, CpuDevice("1GiB")), run_trial(mf, plan, FakeDevice("1GiB"))
    assert not cpu.oom and not fake.oom
    assert cpu.peak_allocated_bytes == fake.peak_allocated_bytes
    from oomtune.levers import prepare_model

    prepare_model(model, plan, mf.label)
    assert is_nf4(model.plain.weight) and not is_nf4(model.own.weight)


@needs_hf
@needs_torchao
def test_a_falcon_qlora_climbs_past_accumulation_without_an_nf4_rung_and_an_nf4_plan_is_one_line():
    """A PEFT LoRA Falcon stopped the probe at the nf4 rung (exit 2, blamed on the model file): every projection is
    a FalconLinear. Now the ladder has no nf4 rung and goes on to offload; a plan asking for NF4 is one line."""
    mf = load_model_file(ROOT / "tests" / "levers" / "models" / "hf_falcon_qlora.py")
    model = mf.build()
    assert frozen_linears(model) == []
    assert any(type(m).__name__ == "FalconLinear" for m in model.modules())
    # (without chunked cross-entropy, which fits it sooner, on its own rung before bf16-true)
    result = probe(mf, CpuDevice("400KiB"), resolve_targets(mf, None, None, None), prior=False,
                   levers=frozenset(LEVERS) - {"chunked-loss"})
    assert result.config is not None and not result.config.plan.nf4_frozen_weights
    assert result.config.plan.offload_optimizer  # (past accumulation: bf16-true, then offload)
    assert not any(r.rung.nf4_frozen_weights for r in result.ladder.rungs)
    with pytest.raises(OomtuneError, match="Falcon's FalconLinear, is left as it is"):
        run_trial(mf, Plan(1, 32, "bf16-true", nf4_frozen_weights=True), CpuDevice("1GiB"))


def test_nn_linear_and_a_subclass_that_only_renames_it_are_both_f_linear():
    from oomtune.levers.nf4 import computes_f_linear

    class Renamed(nn.Linear):
        pass

    assert computes_f_linear(nn.Linear(2, 2)) and computes_f_linear(Renamed(2, 2))
    assert computes_f_linear(nn.MultiheadAttention(4, 2).out_proj)  # (NonDynamicallyQuantizableLinear)
    assert not computes_f_linear(nn.Conv1d(2, 2, 1))
