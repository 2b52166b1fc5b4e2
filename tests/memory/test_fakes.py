"""Fake tensors that take real tensors' code path (oomtune.memory.fakes). device: fake (a FakeTensorMode with
`real_code_paths`, as the fake device measures)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from oomtune.memory.fakes import NeedsValues, real_code_paths, shadow_of


@contextlib.contextmanager
def fake():
    with FakeTensorMode(allow_non_fake_inputs=True), real_code_paths(), torch.device("cpu"):
        yield


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.frozen = nn.Linear(8, 8).requires_grad_(False)


def test_moving_and_casting_a_fake_model_keeps_its_parameters_ties_and_frozen_ones():
    with fake():
        model = Tied()
        weight = model.embed.weight
        model.to("cpu").half().to(torch.float32)
        assert isinstance(model.embed.weight, FakeTensor) and model.embed.weight.dtype == torch.float32
        assert model.embed.weight is weight and model.head.weight is model.embed.weight  # the same Parameter
        assert not model.frozen.weight.requires_grad and model.embed.weight.requires_grad
    assert torch.utils.swap_tensors.__module__ == "torch.utils"  # oomtune's swap is gone once out of the fake device
    # without it, torch refuses the swap. Its FakeTensor dispatch cache is process-wide, and a parameter made from a
    # cache hit has no memo entry (no weak reference) for torch to refuse on, so the control starts from an empty
    # cache: without that it passed the swap once in a full run, after other tests had filled the cache
    FakeTensorMode.cache_clear()
    with FakeTensorMode(allow_non_fake_inputs=True), torch.device("cpu"):
        with pytest.raises(RuntimeError, match="Couldn't swap"):
            nn.Linear(4, 4).to("cpu")


def test_values_computed_from_the_batch_are_read_as_real_ones_give_them():
    with fake():
        mask = torch.ones(2, 6, dtype=torch.long)
        assert isinstance(mask, FakeTensor) and shadow_of(mask) is not None
        assert bool(mask.all()) and int(mask.sum()) == 12
        mask[:, 4:] = 0
        assert not bool(mask.all()) and int(mask.sum()) == 8
        picked = mask.nonzero()  # an output shape from values: known here
        assert isinstance(picked, FakeTensor) and picked.shape == (8, 2)
        positions = torch.arange(6).expand(2, 6)
        assert int((positions * mask).max()) == 3


def test_an_embedding_past_its_rows_fails_as_on_real_tensors():
    """Positions past a model's table (a context longer than it was built for) are known values: the lookup fails
    as the cpu's does, where fake tensors alone would go on (and the estimate said the plan fits)."""
    table = nn.Embedding(8, 4)
    with pytest.raises(IndexError, match="index out of range in self"):
        table(torch.arange(9))
    with fake():
        fake_table = nn.Embedding(8, 4)
        assert fake_table(torch.arange(8)).shape == (8, 4)
        with pytest.raises(IndexError, match="index out of range in self"):
            fake_table(torch.arange(9))
        with pytest.raises(IndexError, match="index out of range in self"):
            fake_table(torch.tensor([-1]))
        unknown = nn.Linear(4, 1)(torch.ones(3, 4)).long().squeeze(1)  # from weights: no values, no check
        assert fake_table(unknown).shape == (3, 4)


def test_values_that_come_from_weights_are_unknown():
    """A weight has no values on the fake device: a scalar read of one reads 0 (GradScaler's found-inf: finite), an
    output shape from one raises NeedsValues (the search then computes on the cpu)."""
    with fake():
        layer = nn.Linear(4, 3)
        x = torch.ones(5, 4)
        scores = layer(x)
        assert shadow_of(scores) is None  # the model's own compute is never run for real
        assert float(scores.sum()) == 0.0
        with pytest.raises(NeedsValues, match="aten.nonzero has an output that depends on tensor values"):
            (scores.argmax(-1) == 1).nonzero()


def test_a_known_tensor_written_with_unknown_values_is_unknown_after():
    with fake():
        ids = torch.zeros(4, dtype=torch.long)
        view = ids[:2]
        weights = nn.Linear(1, 1).weight
        view.copy_(weights.reshape(-1).long().expand(2))  # through a view: the base is stale too
        assert shadow_of(ids) is not None  # the attribute is still there, but it is not trusted:
        with pytest.raises(NeedsValues):
            ids.nonzero()


def test_transformers_is_not_told_a_fake_tensor_is_tracing():
    hf = pytest.importorskip("transformers.utils.import_utils")
    with fake():
        t = torch.ones(2)
        assert hf.is_tracing(t) is False
    with FakeTensorMode():
        assert hf.is_tracing(torch.ones(2)) is True  # outside a measurement transformers' own answer stands


def test_a_few_random_numbers_drawn_for_a_branch_take_it_as_real_ones_do():
    """PEFT's LoHa/LoKr apply their adapter `if torch.rand(1) > module_dropout`: a valueless draw read False, so
    the fake device ran the model without its adapters. A weight-sized draw stays without values."""
    with fake():
        draw = torch.rand(1)
        assert bool(draw > 0.0) and not bool(draw >= 1.0)
        assert bool(torch.randn(2, 3).isfinite().all())
        weight = torch.randn(64, 64)
        assert shadow_of(weight) is None and not bool((weight > 0).any())  # (no values: a weight's reads are 0)


def test_a_fill_of_a_tensor_without_values_is_not_run_and_one_with_values_is():
    """A weight's init (uniform_, normal_, fill_, zero_ of a tensor without values) leaves it without values and
    makes nothing: it never reaches FakeTensorMode (a tenth of a fake build's ops). A fill of a tensor with known
    values still gives them (a mask filled with ones, a draw into zeros), a draw into integers fails as before."""
    with fake():
        weight = torch.empty(4, 4)
        before = FakeTensorMode.cache_hits + FakeTensorMode.cache_misses + sum(FakeTensorMode.cache_bypasses.values())
        for fill in (lambda t: t.uniform_(-1, 1), lambda t: t.normal_(), lambda t: t.fill_(1.0), torch.Tensor.zero_):
            assert fill(weight) is weight
        assert FakeTensorMode.cache_hits + FakeTensorMode.cache_misses + \
            sum(FakeTensorMode.cache_bypasses.values()) == before  # (none dispatched)
        assert shadow_of(weight) is None
        mask = torch.zeros(3)
        mask.fill_(1.0)
        assert int(mask.sum()) == 3
        drawn = torch.zeros(3)
        drawn.uniform_(1, 2)
        assert shadow_of(drawn) is not None and float(drawn.min()) >= 1
        with pytest.raises(RuntimeError):
            torch.empty(3, dtype=torch.long).normal_()
        with pytest.raises(RuntimeError, match="std"):
            torch.empty(3).normal_(0.0, -1.0)  # (a negative std fails as on real tensors)


def test_the_fake_device_runs_values_in_its_tracker_one_mode_fewer():
    """On the fake device, Values is not a mode of its own: the tracker runs its dispatch (one Python call an op
    fewer), and current_values() still finds it (made_calls, made_optim read it)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from oomtune.memory.devices import FakeDevice
    from oomtune.memory.fakes import Values, current_values

    device = FakeDevice("1GiB")
    with device.measure():
        modes = [type(m).__name__ for m in _get_current_dispatch_mode_stack()]
        assert modes == ["FakeTensorMode", "MemoryTracker"]
        assert isinstance(current_values(), Values)
        ids = torch.arange(4)
        assert int(ids.sum()) == 6  # (the known values Values keeps)
    assert device.tracker.inner is None
