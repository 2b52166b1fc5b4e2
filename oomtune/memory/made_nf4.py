"""torchao's NF4 weights on fake tensors: their dequantization and their quantization made from the first of their
kind (made_calls.py) instead of computed.

A frozen NF4 weight is dequantized at each use (torchao's linear_nf4 calls `weight.to(dtype)` in forward, again in
backward, and once more where checkpointing recomputes the forward): about 30 ops a weight, each making the storages
of a weight-sized scratch, and the same for every weight of a shape. A 7B QLoRA trial of 2-4 layers spent a sixth of
its time there; its builds spent as much quantizing (to_nf4: about 60 ops, for the first weight of each shape in each
build). On fake tensors each is made from the first call of its kind: the dequantization per measured stretch
(`made_dequant`, which the fake device enters: kinds are the weight's shape, its inner tensors' shapes and dtypes,
the dtype asked for), the quantization for the process (`made_to_nf4`: a weight's shape and dtype). What they make
and free is the same storages in the same order (tests/levers/test_made_nf4.py: the trial's trace equal, event for
event, to every call computed). Real tensors are always computed.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator

import torch

from .made_calls import MadeCalls, fake_call

INNER = ("quantized_scalers", "quantization_factor", "scaler_mean", "quantized_data", "nf4")  # NF4Tensor's, in the
# order its constructor takes them


def is_nf4(t) -> bool:
    return type(t).__name__ == "NF4Tensor"


def _inner(t) -> list[torch.Tensor]:
    return [getattr(t, name) for name in INNER]


def _meta(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device


def dequant_kind(weight, args: tuple, kwargs: dict) -> tuple | None:
    """The kind of `weight.to(*args, **kwargs)` on an NF4 weight, where it dequantizes (a dtype is asked) and may be
    made; None where it is computed."""
    try:
        inner = _inner(weight)
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    except (AttributeError, TypeError, RuntimeError):
        return None
    where = fake_call(*inner) if dtype is not None else None
    if where is None:
        return None
    return (_meta(weight), weight.block_size, weight.scaler_block_size, weight.n_blocks,
            tuple(_meta(t) for t in inner), device, dtype, non_blocking, memory_format, *where)


NF4_MODULES = ("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "torchao.dtypes.nf4tensor")  # torchao's,
# newer and older
_STRETCHES: list[MadeCalls] = []  # the measured stretches inside made_dequant(), innermost last


@contextlib.contextmanager
def made_dequant() -> Iterator[None]:
    """NF4 weights' `.to(dtype)` (their dequantization) made from the first of its kind, in one measured stretch.
    torchao's NF4Tensor answers `.to` from its table of torch functions, which every caller reaches (the forward,
    linear_nf4's backward, checkpointing's recomputation, where no TorchFunctionMode is active): that table's entry
    is wrapped once for the process (`hook`), where torchao's NF4 module is loaded when a stretch begins, or when
    made_to_nf4 (the NF4 lever's quantization) makes a weight. Outside a stretch, or on real tensors, the wrapper
    calls torchao's own. (A model file that loads torchao inside its build has its first trial computed.)"""
    for name in NF4_MODULES:
        if name in sys.modules:
            hook(sys.modules[name])
    _STRETCHES.append(MadeCalls())
    try:
        yield
    finally:
        _STRETCHES.pop()


def hook(module) -> None:
    """Wrap the `.to` entry of torchao's NF4 torch function table in `module`, once (see made_dequant)."""
    table = getattr(module, "NF4_TORCH_FUNCTIONS", None)
    own = table.get(torch.Tensor.to) if isinstance(table, dict) else None
    if own is None or getattr(own, "made_from_first", False):
        return

    def to(*args, **kwargs):
        calls = _STRETCHES[-1] if _STRETCHES else None
        kind = dequant_kind(args[0], args[1:], kwargs) if calls is not None else None
        if kind is None:
            return own(*args, **kwargs)
        return calls(kind, lambda: own(*args, **kwargs), lambda out: [out], lambda made: made[0])

    to.made_from_first = True
    table[torch.Tensor.to] = functools.update_wrapper(to, own)


QUANTIZED = MadeCalls()  # to_nf4's patterns, for the process: a build quantizes the first weight of each shape


def made_to_nf4(to_nf4: Callable, weight: torch.Tensor, block_size: int, scaler_block_size: int):
    """to_nf4(weight, block_size, scaler_block_size), made from the first quantization of its kind where the weight
    is fake (the NF4 tensor rebuilt around the inner tensors made, by to_nf4's own module)."""
    library = sys.modules[to_nf4.__module__]
    hook(library)
    where = fake_call(weight)
    kind = (_meta(weight), block_size, scaler_block_size, *where) if where is not None else None
    return QUANTIZED(kind, lambda: to_nf4(weight, block_size, scaler_block_size), _inner,
                     lambda inner: nf4_tensor(library, weight, block_size, scaler_block_size, inner))


def nf4_tensor(library, weight: torch.Tensor, block_size: int, scaler_block_size: int, inner: list[torch.Tensor]):
    """The NF4Tensor of `library` (torchao's NF4 module) for `weight`'s shape, around `inner` (INNER's order)."""
    meta = library.SubclassTensorArgs(weight.size(), weight.stride(), weight.storage_offset(), weight.dtype,
                                      weight.device, weight.requires_grad)
    return library.NF4Tensor(meta, block_size, weight.numel() // block_size, scaler_block_size, *inner)
