"""FakeTensorMode's dispatch-cache keys laid out in fewer Python calls (oomtune.memory.cache_keys): the same keys as
torch's own. device: fake (FakeTensorMode, as the fake device runs it)."""

from __future__ import annotations

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode

from oomtune.memory import cache_keys
from oomtune.memory.cache_keys import fast_cache_keys


def _key_of(mode: FakeTensorMode, t: torch.Tensor) -> list:
    out: list = []
    state = fake_tensor._CacheKeyState(mode.shape_env)
    fake_tensor.extract_tensor_metadata(t)._flatten_into(out, mode, state)
    return out


def test_the_keys_are_torchs_own_on_every_kind_of_tensor():
    """Contiguous, transposed, channels-last 2d and 3d, a view at an offset, 0-d, empty, with a gradient, bf16,
    int, expanded (stride 0): inside, the key of each is element for element (and type for type) torch's."""
    mode = FakeTensorMode()
    with mode:
        base = torch.empty(2, 3, 4, 5)
        tensors = [*(mode.from_tensor(t) for t in cache_keys._samples()), base.expand(3, 2, 3, 4, 5),
                   base.permute(3, 2, 1, 0), torch.empty(4, 4).diagonal()]
    torchs = [_key_of(mode, t) for t in tensors]
    with fast_cache_keys():
        assert fake_tensor.extract_tensor_metadata is not cache_keys._ORIGINAL_EXTRACT  # (in use here)
        ours = [_key_of(mode, t) for t in tensors]
    assert fake_tensor.extract_tensor_metadata is cache_keys._ORIGINAL_EXTRACT  # (torch's again outside)
    assert ours == torchs
    assert [[type(x) for x in k] for k in ours] == [[type(x) for x in k] for k in torchs]


def test_a_step_keyed_so_hits_the_entries_torchs_keys_made():
    """A small model's forward, backward and optimizer step run twice on fake tensors of the same shapes: once with
    torch's keys (every entry made), then inside fast_cache_keys: no new entry is made (each key is one torch made),
    so the outputs come from the same entries."""
    def step():
        with FakeTensorMode():
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                                        torch.nn.Linear(16, 4))
            opt = torch.optim.AdamW(model.parameters(), foreach=True)
            model(torch.randn(3, 8)).square().mean().backward()
            opt.step()

    FakeTensorMode.cache_clear()
    step()
    made = len(FakeTensorMode.cache)
    with fast_cache_keys():
        step()
    assert made > 20 and len(FakeTensorMode.cache) == made


def test_a_sparse_tensor_takes_torchs_own_way():
    """Not strided: `_extract` hands it to torch's own (which the cache then bypasses, as it always did)."""
    mode = FakeTensorMode()
    sparse = mode.from_tensor(torch.eye(3).to_sparse())
    with fast_cache_keys():
        assert cache_keys._extract(sparse) == cache_keys._ORIGINAL_EXTRACT(sparse)


def test_where_they_do_not_agree_with_torchs_torchs_own_run(monkeypatch):
    """Another torch's internals (TensorMetadata with other fields): the check fails, and inside, torch's own code
    lays out the keys."""
    monkeypatch.setattr(cache_keys, "_CHECKED", [])
    monkeypatch.setattr(cache_keys, "FIELDS", (*cache_keys.FIELDS, "another"))
    with fast_cache_keys():
        assert fake_tensor.extract_tensor_metadata is cache_keys._ORIGINAL_EXTRACT
    assert cache_keys._CHECKED == [False]
