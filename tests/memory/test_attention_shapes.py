"""The fused attention kernels' results made from their layouts on valueless fake tensors (memory/attention_shapes.py)
instead of running PyTorch's math composite: the same tensors (shape, strides, dtype, storage bytes) and the same
trace, event for event, as with the composite."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from oomtune.config.schema import Plan
from oomtune.memory import attention_shapes, cuda_attention
from oomtune.memory.cards import find_gpu
from oomtune.memory.cuda_attention import Call
from oomtune.memory.devices import FakeDevice
from oomtune.model_file import load_model_file
from oomtune.search.trial import run_trial

ROOT = Path(__file__).parents[2]
BF16, FP32 = torch.bfloat16, torch.float32


def _described(t: torch.Tensor | None):
    if t is None:
        return None
    return tuple(t.shape), t.stride(), t.dtype, t.untyped_storage().nbytes(), t.storage_offset()


def _qkv(b, h, t, d, dtype, kv_heads=None, contiguous=False):
    def one(heads):
        x = torch.randn(b, t, heads, d, dtype=dtype)
        x = x.transpose(1, 2)
        return (x.contiguous() if contiguous else x).requires_grad_()
    return one(h), one(kv_heads or h), one(kv_heads or h)


@pytest.mark.parametrize("kw", [
    {"causal": True}, {"mask": "float"}, {"gqa": True, "kv_heads": 2}, {"contiguous": True, "dtype": FP32},
    {"dropout": 0.1, "t": 128},  # a mask past the random numbers the fake device keeps
])
def test_made_results_are_the_composites(kw):
    """device: fake tensors. Forward output and the q, k, v gradients, made, equal the composite's layouts."""
    kw = dict(kw)
    dtype, kv_heads, t = kw.pop("dtype", BF16), kw.pop("kv_heads", None), kw.pop("t", 64)
    contiguous = kw.pop("contiguous", False)
    with FakeTensorMode():
        q, k, v = _qkv(2, 4, t, 32, dtype, kv_heads, contiguous)
        mask = torch.zeros(t, t, dtype=dtype) if kw.pop("mask", None) else None
        c = Call(q, k, v, mask, **kw)
        assert attention_shapes.valueless((q, k, v, mask), c.dropout, cuda_attention._attention_elements(c))
        made = cuda_attention._fused_values(c)
        run = cuda_attention._math(c).detach()
        assert _described(made) == _described(run)
        dout = torch.randn(*run.shape, dtype=dtype).transpose(1, 2).contiguous().transpose(1, 2)
        ins = [x.detach().requires_grad_(x.requires_grad) if x is not None else None for x in (q, k, v, mask)]
        made_grads = cuda_attention._fused_grads(ins, cuda_attention._options(c), dout)
        out = cuda_attention._math(Call(*ins, *cuda_attention._options(c)))
        wanted = [x for x in ins if x is not None and x.requires_grad]
        ran = iter(torch.autograd.grad(out, wanted, dout))
        ran_grads = [next(ran) if x is not None and x.requires_grad else None for x in ins]
        assert [_described(g) for g in made_grads] == [_described(g) for g in ran_grads]


def test_values_that_are_known_run_the_composite():
    """device: real and fake tensors. Real inputs, and small dropout masks the fake device would draw, are not
    answered by layouts."""
    q, k, v = _qkv(1, 2, 4, 8, FP32)
    assert not attention_shapes.valueless((q, k, v, None), 0.0, 16)
    with FakeTensorMode():
        q, k, v = _qkv(1, 2, 4, 8, FP32)
        assert attention_shapes.valueless((q, k, v, None), 0.0, 16)
        assert not attention_shapes.valueless((q, k, v, None), 0.1, 16)


@pytest.mark.parametrize(("card", "plan"), [
    ("a100-80", Plan(4, 64, "bf16", activation_checkpointing=True)),  # flash, recomputed in backward
    ("t4", Plan(3, 64, "fp32")),  # efficient, fp32
])
def test_a_trial_traces_the_same_events_either_way(monkeypatch, card, plan):
    """device: fake (a card's rules). The whole trial's trace, event for event, with the composite run and with
    the results made."""
    mf = load_model_file(ROOT / "examples" / "tiny_gpt.py")

    def trace():
        return run_trial(mf, plan, FakeDevice("80GiB", gpu=find_gpu(card), never_runs_out=True, traces=True)).trace

    calls = []
    monkeypatch.setattr(cuda_attention, "made", lambda *a: calls.append(1) or attention_shapes.made(*a))
    made = trace()
    assert calls, "the results were not made from layouts"
    monkeypatch.setattr(cuda_attention, "valueless", lambda *a: False)
    ran = trace()
    assert made.events == ran.events and made.initial == ran.initial
