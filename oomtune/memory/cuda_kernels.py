"""The kernels a CUDA card runs where the CPU runs others that keep different memory, on the cpu and fake devices.

Two ops choose their kernel by device, in code the simulated devices would otherwise follow the CPU's way through:

- scaled_dot_product_attention: a flash, memory-efficient or math kernel, by the card's rules (cuda_attention.py);
- dropout: on CUDA the fused `native_dropout`, whose backward keeps a bool mask (1 byte an element); on the CPU
  `input * noise`, which keeps a float noise tensor of the input's dtype (4 bytes an element in fp32). PyTorch's
  at::dropout takes the fused kernel for CUDA inputs with 0 < p < 1 (is_fused_kernel_acceptable).

Both are registered on the AutogradCPU dispatch key while `cuda_kernels(card)` is active: below autocast (CUDA
autocast's casts come first, cuda_autocast.py), above autograd (their own backward), and reached from every caller,
checkpointing's recomputation included (a TorchFunctionMode is not active there)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

from .cards import GpuSpec
from .cuda_attention import Call, attention


def _dropout(x: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """at::dropout as it runs on a CUDA tensor."""
    if not train or p == 0 or x.numel() == 0:
        return x
    if p < 1:
        return torch.ops.aten.native_dropout(x, p, train)[0]
    return x * torch.zeros((), dtype=x.dtype, device=x.device)  # p = 1: the unfused way, all zeros


@contextlib.contextmanager
def cuda_kernels(card: GpuSpec) -> Iterator[None]:
    """Inside, SDPA and dropout on cpu tensors (fake ones too) run as on `card` (see the module doc)."""
    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
        return attention(card, Call(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa))

    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore")
        lib.impl("scaled_dot_product_attention", sdpa, "AutogradCPU")
        lib.impl("dropout", _dropout, "AutogradCPU")
    try:
        yield
    finally:
        lib._destroy()
