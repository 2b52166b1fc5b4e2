"""Swappable fake parameters (fakes.py, 1): `Module._apply` (`.to()`, `.half()`, PEFT putting an adapter next to
its base layer) swaps a FakeTensor parameter's contents with `torch.utils.swap_tensors`, which refuses a tensor
something holds a weak reference to, and FakeTensorMode memoises every tensor it makes by weak reference.
`swappable_fakes` drops a tensor's memo entries just before it is swapped, so the swap keeps the Parameter object:
tied weights stay tied, frozen ones stay frozen, and its hooks stay on it."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.weak import WeakIdRef

_SWAP = torch.utils.swap_tensors


def _forget(t: torch.Tensor) -> None:
    """Drop the fake mode's weak references to `t`: its memo entries (the converter's, and its meta converter's,
    where `copy.deepcopy` made it: nn.TransformerEncoder's layers), and, for a constant, its alias list."""
    if not isinstance(t, FakeTensor) or not weakref.getweakrefcount(t):
        return
    converter = t.fake_mode.fake_tensor_converter
    meta = getattr(getattr(converter, "meta_converter", None), "tensor_memo", {})  # (a deep copy's, by its id)
    for memo in (converter.tensor_memo, meta):
        for key in [k for k, v in list(memo.items()) if v is t]:
            del memo[key]
    for refs in getattr(converter, "constant_storage_mapping", {}).values():
        refs[:] = [r for r in refs if r() is not t]
    for ref in weakref.getweakrefs(t):  # what is left: a deep copy's entries in another converter's memo and its
        for d in gc.get_referrers(ref):  # describer's id lookup, found the slow way (none left for other tensors)
            if not isinstance(d, dict):
                continue
            if isinstance(ref, weakref.KeyedRef) and d.get(ref.key) is ref:
                del d[ref.key]
            elif isinstance(ref, WeakIdRef) and any(k is ref for k in d):
                del d[ref]


_TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def _swap_fakes(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """The swap, and `t1`'s own hooks (`register_hook`, `register_post_accumulate_grad_hook`: a model file's
    optimizer-in-backward) kept on it: autograd keeps them with the tensor's contents, which the swap hands to `t2`,
    where `param.data = ...` (a real tensor's cast) keeps them. Setting them again registers them for the new
    contents."""
    hooks = {name: getattr(t1, name, None) for name in _TENSOR_HOOKS}
    _forget(t1)
    _forget(t2)
    _SWAP(t1, t2)
    for name, value in hooks.items():
        if value:
            setattr(t1, name, value)


@contextlib.contextmanager
def swappable_fakes() -> Iterator[None]:
    """While inside, `Module._apply` can swap FakeTensor parameters (see the module doc, 1)."""
    torch.utils.swap_tensors = _swap_fakes
    try:
        yield
    finally:
        torch.utils.swap_tensors = _SWAP
