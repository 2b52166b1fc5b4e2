"""The tensors the math attention backend returns, without running it on fake tensors (memory/cuda_attention.py).

A flash or memory-efficient kernel's values are computed the CPU's way (PyTorch's composite math backend) and not
counted; only their memory is. On the fake device, where nothing is computed, that composite still costs its
Python: a dozen ops forward, and forward again plus autograd through them in backward, each through the fake
mode's dispatch (a quarter of a warm GPT-2 small trial). What the kernel's caller gets is only tensors of some
shape, strides and dtype, and those depend on the inputs' shapes, strides, dtypes and flags alone: they are found
once per kind of call by running the same composite on meta tensors, outside every mode (C++ only, microseconds),
and made directly (empty_strided) from then on.

Only where no value could be known: fake inputs without real copies (fakes.shadow_of), and no dropout that would
draw random numbers the fake device keeps (fakes.RANDOM_FACTORIES). Anywhere else, or where a result is not a
dense tensor that owns its whole storage from its start, the composite runs as before.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from .fakes import MAX_RANDOM_SHADOW, shadow_of

Layout = tuple  # (shape, stride, dtype)
_SEEN: dict[tuple, tuple[Layout, ...] | None] = {}  # a call's key -> its results' layouts (None: make them by running)


def _key(t: torch.Tensor | None) -> tuple | None:
    if t is None:
        return None
    return tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad


def valueless(tensors, dropout: float, attention_elements: int) -> bool:
    """Whether a math call on these inputs may be answered by layouts: fake inputs with no real values behind them,
    and no dropout draw small enough for the fake device to keep its values."""
    present = [t for t in tensors if t is not None]
    if not present or not all(isinstance(t, FakeTensor) and shadow_of(t) is None for t in present):
        return False
    return dropout == 0.0 or attention_elements > MAX_RANDOM_SHADOW


def _meta(key: tuple | None) -> torch.Tensor | None:
    if key is None:
        return None
    shape, stride, dtype, grad = key
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta").requires_grad_(grad)


def _layout(t: torch.Tensor) -> Layout | None:
    """A result's (shape, stride, dtype), where empty_strided makes the same storage: offset 0, no more bytes."""
    if t.layout != torch.strided or t.storage_offset() != 0:
        return None
    made = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    if made.untyped_storage().nbytes() != t.untyped_storage().nbytes():
        return None
    return tuple(t.shape), tuple(t.stride()), t.dtype


def result_layouts(run, inputs: tuple, extra: tuple = (), grad_of: torch.Tensor | None = None,
                   ) -> tuple[Layout, ...] | None:
    """The layouts of `run(*meta inputs)`'s result (forward) or, with `grad_of` (the output's gradient), of the
    gradients of the inputs that require one, in order; cached by the inputs' keys and `extra` (the call's options).
    None where some result has no plain layout (the caller then runs the composite)."""
    keys = tuple(_key(t) for t in inputs)
    key = (keys, extra, _key(grad_of))
    if key not in _SEEN:
        with _disable_current_modes(), torch.enable_grad(), _own_saved_tensors():
            metas = [_meta(k) for k in keys]
            out = run(*metas)
            if grad_of is None:
                results = [out]
            else:
                wanted = [m for m in metas if m is not None and m.requires_grad]
                results = list(torch.autograd.grad(out, wanted, _meta(_key(grad_of)))) if wanted else []
            layouts = [_layout(r) for r in results]
        _SEEN[key] = None if any(x is None for x in layouts) else tuple(layouts)
    return _SEEN[key]


def _own_saved_tensors():
    """Saved-tensor hooks of its own (kept as they are) over whatever the caller's are: checkpointing's hooks
    count the tensors a forward saves, and the meta run's are none of theirs."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


def made(layouts: tuple[Layout, ...], device: torch.device) -> list[torch.Tensor]:
    """Tensors of those layouts on `device` (values undefined: the fake device has none)."""
    return [torch.empty_strided(shape, stride, dtype=dtype, device=device) for shape, stride, dtype in layouts]
