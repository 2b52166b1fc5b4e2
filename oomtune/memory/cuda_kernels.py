"""The kernels a CUDA card runs where the CPU runs others that keep different memory, on the cpu and fake devices.

Three ops choose their kernel by device, in code the simulated devices would otherwise follow the CPU's way through:

- scaled_dot_product_attention: a flash, memory-efficient or math kernel, by the card's rules (cuda_attention.py);
- dropout: on CUDA the fused `native_dropout`, whose backward keeps a bool mask (1 byte an element); on the CPU
  `input * noise`, which keeps a float noise tensor of the input's dtype (4 bytes an element in fp32). PyTorch's
  at::dropout takes the fused kernel for CUDA inputs with 0 < p < 1 (is_fused_kernel_acceptable);
- softmax and log_softmax of an fp16 tensor into fp32 (autocast's fp32 softmax of fp16 scores, or dtype=float32
  given): on CUDA one kernel that reads fp16 and writes fp32; on the CPU an fp32 copy of the input first
  (aten/native/SoftMax.cpp).

Both are registered on the AutogradCPU dispatch key while `cuda_kernels(card)` is active: below autocast (CUDA
autocast's casts come first, cuda_autocast.py), above autograd (their own backward), and reached from every caller,
checkpointing's recomputation included (a TorchFunctionMode is not active there)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

from .cards import GpuSpec
from .cuda_attention import Call, attention
from .overrides import overriding
from .tracker import adopt, untracked


def _dropout(x: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """at::dropout as it runs on a CUDA tensor."""
    if not train or p == 0 or x.numel() == 0:
        return x
    if p < 1:
        return torch.ops.aten.native_dropout(x, p, train)[0]
    return x * torch.zeros((), dtype=x.dtype, device=x.device)  # p = 1: the unfused way, all zeros


class _HalfToFloat(torch.autograd.Function):
    """softmax / log_softmax of an fp16 tensor into fp32 as CUDA runs it (aten/native/SoftMax.cpp): one kernel that
    reads fp16 and writes fp32, `_softmax(x, dim, half_to_float=True)`, where the CPU first makes an fp32 copy of
    the input (and its backward an fp32 gradient before the fp16 one). The values are the CPU's; what is counted
    is the CUDA kernel's: the fp32 output (saved for backward), and in backward the fp16 gradient alone."""

    @staticmethod
    def forward(ctx, x, dim: int, log: bool):
        with untracked():
            out = (torch.ops.aten._log_softmax if log else torch.ops.aten._softmax)(x.float(), dim, False)
        adopt(out)
        ctx.dim, ctx.log = dim, log
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        backward = torch.ops.aten._log_softmax_backward_data if ctx.log else torch.ops.aten._softmax_backward_data
        with untracked():
            grad_in = backward(grad, out, ctx.dim, torch.float32).to(torch.float16)
        adopt(grad_in)
        return grad_in, None, None


def _softmax(log: bool):
    """softmax.int / log_softmax.int as at::softmax runs them: fp16 into fp32 on a CUDA tensor as one fused kernel
    (_HalfToFloat); otherwise the input in the output dtype, then the op (the composite's own way)."""
    def kernel(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        if x.dtype == torch.float16 and dtype == torch.float32:
            return _HalfToFloat.apply(x, dim, log)
        x = x if dtype is None else x.to(dtype)
        return (torch.ops.aten._log_softmax if log else torch.ops.aten._softmax)(x, dim, False)
    return kernel


_NATIVE = [0]  # inside native_attention(): SDPA as torch itself runs it
_CARD = [0]  # inside cuda_kernels()


class _NoAttentionDropout(TorchFunctionMode):
    """SDPA called without dropout: CUDA's fused kernels draw its mask inside and keep none, where the CPU takes
    its math kernel for dropout, which keeps the attention weights."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.nn.functional.scaled_dot_product_attention:
            named = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"), args[3:], strict=False))
            args, kwargs = args[:3], {**named, **kwargs, "dropout_p": 0.0}
        return func(*args, **kwargs)


@contextlib.contextmanager
def native_attention() -> Iterator[None]:
    """SDPA as torch's own op: AOTAutograd tracing a compiled call (compiled.py) records the fused attention op a
    compiled graph calls (on the CPU, its flash kernel: the output and the log-sum-exp saved, as the CUDA flash
    kernel saves), not the card model's computation of it; with a card's rules, without dropout (as CUDA's)."""
    _NATIVE[0] += 1
    try:
        with _NoAttentionDropout() if _CARD[0] else contextlib.nullcontext():
            yield
    finally:
        _NATIVE[0] -= 1


@contextlib.contextmanager
def cuda_kernels(card: GpuSpec) -> Iterator[None]:
    """Inside, SDPA and dropout on cpu tensors (fake ones too) run as on `card` (see the module doc)."""
    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
        if _NATIVE[0]:  # (traced without dropout: _NoAttentionDropout)
            return torch.ops.aten.scaled_dot_product_attention.default.decompose(
                q, k, v, attn_mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa)
        return attention(card, Call(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa))

    _CARD[0] += 1
    try:
        with overriding("AutogradCPU", {"scaled_dot_product_attention": sdpa, "dropout": _dropout,
                                        "softmax.int": _softmax(log=False), "log_softmax.int": _softmax(log=True)}):
            yield
    finally:
        _CARD[0] -= 1
