"""Where PyTorch's meta kernels differ from the CPU's own: on the fake device, outputs are made as the cpu device's
real kernels make them, so that the two devices still agree to the byte.

Three so far.

- Grouped matmul (`aten._grouped_mm`, the experts of transformers' mixture-of-experts models): the CPU's kernel
  takes any floating dtype, the meta kernel only CUDA's bf16 ("Expected inputs of BF16 type"), so an fp32 Mixtral
  failed on fake tensors alone. Its output is shaped from the same op in bf16 and made in the inputs' dtype (or
  out_dtype), contiguous, as the CPU's kernel makes it.
- nn.LSTM on the CPU runs oneDNN (`aten.mkldnn_rnn_layer`, one call a layer and direction). Its fourth output is a
  workspace kept for the backward (every time step's gates and states, in oneDNN's own padded layout), which the
  meta kernel returns empty: a 2-layer LSTM's saved activations read 2.97 MiB on fake tensors against 10.57 MiB
  computed. The size is oneDNN's to choose and not a formula of the shapes (it moves in 4 KiB pages), so it is read
  from one real call on zeros of the same shapes (the values play no part in it), once a shape; for a shape that
  would allocate more than 64 MiB, from smaller ones, scaled (_workspace_bytes).
- GroupNorm of a bf16 or fp16 input with fp32 weights (CPU autocast leaves group_norm's input in bf16): ATen's
  kernel keeps the mean and reciprocal deviation in fp32 and makes the input's gradient in the input's dtype; the
  meta kernel makes the statistics in the input's dtype and the gradient in fp32 (a bf16 CNN's backward read
  +64 KiB on fake tensors, and `check` refused the plan `probe` had just written). Those outputs are made again in
  ATen's dtypes (group_norm.cpp, shared by the CPU and CUDA).

On a card (`--gpu`) nn.LSTM would run cuDNN, whose reserve space is its own size again: both simulated devices count
oneDNN's workspace in its place (docs/devices.md).
"""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import _disable_current_modes

_LSTM_LAYER = getattr(getattr(torch.ops.aten, "mkldnn_rnn_layer", None), "default", None)
_GROUPED_MM = getattr(getattr(torch.ops.aten, "_grouped_mm", None), "default", None)
_GROUP_NORM = torch.ops.aten.native_group_norm.default
_GROUP_NORM_BACKWARD = torch.ops.aten.native_group_norm_backward.default
_SIZES: dict[tuple, int] = {}  # signature -> workspace elements, for the process (a shape's size never changes)
_REAL_BYTES = 64 << 20  # the most one real call that reads a workspace's size may allocate, roughly


def _signature(args) -> tuple:
    """What oneDNN's workspace size can depend on: every argument, tensors by shape and dtype."""
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else
                 tuple(a) if isinstance(a, (list, tuple)) else a for a in args)


def cpu_kernel_call(func, args, kwargs):
    """`func(*args, **kwargs)` on fake tensors, its outputs made as the CPU's kernels make them (module doc). Called
    from a dispatch mode's handler, inside FakeTensorMode and below the tracker: an LSTM layer's workspace is made
    at oneDNN's size, as an output of that op, where the tracker counts it. The fake device calls it from
    fakes.Values' own dispatch."""
    if func is _GROUPED_MM and args[0].dtype != torch.bfloat16:
        return _grouped_mm(func, args, kwargs)
    out = func(*args, **kwargs)
    if func is _GROUP_NORM or func is _GROUP_NORM_BACKWARD:
        return _group_norm_dtypes(func, args, out)
    if func is _LSTM_LAYER and not kwargs and out[3] is not None and out[3].numel() == 0:
        size = _workspace_elements(args)
        if size:
            out = (*out[:3], torch.empty(size, dtype=out[3].dtype, device=out[3].device))
    return out


def _workspace_elements(args) -> int:
    key = (_signature(args), torch.is_grad_enabled())
    if key not in _SIZES:
        _SIZES[key] = _workspace_bytes(args)
    return _SIZES[key]


def _workspace_bytes(args) -> int:
    """oneDNN's workspace for mkldnn_rnn_layer(args): read from one real call on zeros where that allocates at most
    _REAL_BYTES; past that (a long context, a large batch or hidden size), from calls at a smaller shape scaled up:
    the time steps from two lengths (the size is affine in them), the batch and hidden size in proportion (within a
    few percent, measured), rounded up to whole 4 KiB pages."""
    steps, batch, width = args[0].shape
    hidden = args[10]
    esize = args[0].element_size()
    weights = lambda h, w: 4 * h * (w + h) * esize  # noqa: E731
    cost = lambda t, b, h, w: weights(h, w) + t * b * (w + h) * esize + 64 * t * b * h  # noqa: E731 (bytes, roughly)
    t, b, h, w = steps, batch, hidden, width
    projected = args[2].shape[-1] != hidden  # (an LSTM with proj_size: its hidden size stays)
    while cost(t, b, h, w) > _REAL_BYTES:
        if weights(h, w) > _REAL_BYTES // 4 and h > 8 and not projected:
            h, w = h // 2, max(1, w // 2)
        elif b > 1:
            b = (b + 1) // 2
        elif t > 2:
            t //= 2
        else:
            break
    at = _real_call(args, t, b, h, w)
    if (t, b, h) == (steps, batch, hidden):
        return at
    if t < steps:  # affine in the steps: its slope from twice as many
        at += (_real_call(args, 2 * t, b, h, w) - at) / t * (steps - t)
    return math.ceil(at * batch / b * hidden / h / 4096) * 4096


def _real_call(args, steps: int, batch: int, hidden: int, width: int) -> int:
    """The workspace mkldnn_rnn_layer makes for `args` at another shape, on zeros (outside every mode, in the
    caller's grad mode: oneDNN keeps none without grad)."""
    old_hidden, real = args[10], list(args)

    def zeros(t: torch.Tensor, *shape: int) -> torch.Tensor:
        return torch.zeros(shape if t.numel() else t.shape, dtype=t.dtype)

    with _disable_current_modes():
        real[0] = zeros(args[0], steps, batch, width)
        if hidden != old_hidden:
            real[1], real[2] = zeros(args[1], 4 * hidden, width), zeros(args[2], 4 * hidden, hidden)
            real[3], real[4] = zeros(args[3], 4 * hidden), zeros(args[4], 4 * hidden)
        else:
            real[1:5] = [zeros(a, *a.shape) for a in args[1:5]]
        real[5], real[6] = (zeros(a, batch, *(a.shape[1:] if hidden == old_hidden else (hidden,))) for a in args[5:7])
        real[10] = hidden
        workspace = _LSTM_LAYER(*real)[3]
    return 0 if workspace is None else workspace.numel()


def _grouped_mm(func, args, kwargs) -> torch.Tensor:
    """_grouped_mm(self, mat2, offs=None, bias=None, out_dtype=None) in a dtype the meta kernel refuses."""
    named = dict(zip(("self", "mat2", "offs", "bias", "out_dtype"), args, strict=False)) | kwargs
    dtype = named.pop("out_dtype", None) or named["self"].dtype
    as_bf16 = {k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
               for k, v in named.items()}
    a, b = as_bf16.pop("self"), as_bf16.pop("mat2")
    return torch.empty(func(a, b, **as_bf16).shape, dtype=dtype, device=named["self"].device)


__all__ = ["cpu_kernel_call"]


def _group_norm_dtypes(func, args, out: tuple) -> tuple:
    """native_group_norm(X, gamma, beta, ...) -> (Y, mean, rstd), and its backward(dY, X, mean, rstd, gamma, ...)
    -> (dX, dgamma, dbeta), with the outputs in the dtypes ATen's kernel makes them (module doc)."""
    if func is _GROUP_NORM_BACKWARD:  # the gradient as ATen makes it: like the input, its layout too
        x = args[1]
        keep = out[0] is None or out[0].dtype == x.dtype
        return out if keep else (torch.empty_like(x), *out[1:])
    x, params = args[0], [t for t in args[1:3] if isinstance(t, torch.Tensor)]
    mixed = x.dtype in (torch.bfloat16, torch.float16) and any(t.dtype == torch.float32 for t in params)
    return (out[0], *(torch.empty_like(t, dtype=torch.float32) for t in out[1:])) if mixed else out
