"""`scaled_dot_product_attention` on the cpu and fake devices as a CUDA card would run it: the same backend, and the
memory that backend keeps.

On CUDA, SDPA picks a kernel at run time (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, in PyTorch's default
priority order: flash, then memory-efficient, then math) from the inputs' dtype, shapes, strides, mask, dropout and
the card's compute capability (`choose_backend`). The three keep very different memory for backward:

- flash saves the output and a (B, H, T) fp32 logsumexp; its backward allocates softmax_d (B, H, T128) fp32 and
  dq_accum (B, T128, H, D32) fp32 besides the gradients; a head dim that is not a multiple of 8 is padded (copies
  of q, k, v, an output and gradients stored padded);
- efficient (equal query and key heads only: grouped ones, enable_gqa or not, go to math) saves the output, a
  (B, H, T32) fp32 logsumexp and the mask (a float tensor of q's dtype; copied with its last dim padded to 8 where
  its strides are not aligned to 8); its backward allocates delta (B, H, T) fp32 and
  a (B, H, T, D) fp32 accumulator for grad_q (kernel_backward.h's kNeedsAccumGradQ: fp16/bf16, or keys split
  across blocks, sm70 and newer);
- math saves softmax(QK^T), (B, H, T, T), and whatever else its ops save (fp16/bf16 inputs computed in fp32).

torch.backends.cuda's switches (sdpa_kernel) turn backends off as on CUDA.

(T128, T32: T rounded up to a multiple of 128, 32; D32: the head dim rounded up to 32, 256 past 192; from the
kernels' allocations in attention.cu / attention_backward.cu and flash-attention's mha_bwd.)

The math backend is PyTorch's own composite (`_scaled_dot_product_attention_math`), run as is. For flash and
efficient, `_FusedAttention` computes the values the CPU's way without counting them (tracker.untracked), then
counts exactly what the CUDA kernel allocates: the output, its logsumexp, the gradients and the scratch.
cuDNN attention (which PyTorch prefers on sm90/sm100 with cuDNN newer than 9.15, a version the user's install
decides) is never chosen: where it would run, flash keeps what it keeps (the output and a (B, H, T, 1) fp32
statistic); where flash is refused (a mask), the efficient kernel is taken.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention_shapes import made, result_layouts, valueless
from .cards import GpuSpec
from .tracker import adopt, untracked

_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Call:
    """The arguments of one SDPA call, as the backend choice sees them."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None = None
    dropout: float = 0.0
    causal: bool = False
    scale: float | None = None
    gqa: bool = False

    @property
    def needs_grad(self) -> bool:
        return torch.is_grad_enabled() and any(t.requires_grad for t in (self.q, self.k, self.v))


def _in(cc: tuple[int, int], lo: tuple[int, int], hi: tuple[int, int]) -> bool:
    return lo <= cc <= hi


def _dense_ok(c: Call, gqa_ok: bool) -> bool:
    """The checks flash and efficient share: 4-d inputs, non-empty sequences, unit last stride (the mask's too, on a
    GPU), one batch size, heads equal (or grouped, with enable_gqa)."""
    q, k, v = c.q, c.k, c.v
    if not (q.dim() == k.dim() == v.dim() == 4):
        return False
    if 0 in (q.shape[2], k.shape[2], v.shape[2]) or any(t.stride(-1) != 1 for t in (q, k, v)):
        return False
    if c.mask is not None and c.mask.shape[-1] > 1 and c.mask.stride(-1) != 1:
        return False
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        return False
    hq, hk, hv = q.shape[1], k.shape[1], v.shape[1]
    if hq == hk == hv:
        return True
    return gqa_ok and c.gqa and hk == hv and hq % hk == 0


def can_use_flash(card: GpuSpec, c: Call) -> bool:
    cc, d = card.compute_capability, c.q.shape[-1]
    if not torch.backends.cuda.flash_sdp_enabled() or c.mask is not None or not _dense_ok(c, gqa_ok=True):
        return False
    if not (c.q.shape[-1] == c.k.shape[-1] == c.v.shape[-1] and d <= 256):
        return False
    if not _in(cc, (8, 0), (12, 1)) or c.q.dtype not in _HALF:
        return False
    if c.needs_grad and (_in(cc, (8, 6), (8, 9)) or _in(cc, (12, 0), (12, 1))):
        if not (d <= 192 or (c.dropout == 0 and d > 224)):  # flash's backward refuses these head dims there
            return False
    return not (c.causal and c.q.shape[2] != c.k.shape[2])


def gemm_alignment(cc: tuple[int, int], half: bool) -> int:
    """minimum_gemm_alignment: elements the head dims must be a multiple of for the efficient kernel."""
    tensor_cores = cc >= (8, 0) or (cc >= (7, 0) and half)
    n = 4 if cc >= (8, 0) else 1
    return max(n, 128 // (16 if half else 32)) if tensor_cores else n


def can_use_efficient(card: GpuSpec, c: Call) -> bool:
    cc = card.compute_capability
    if not torch.backends.cuda.mem_efficient_sdp_enabled() or not _in(cc, (5, 0), (12, 1)) \
            or not _dense_ok(c, gqa_ok=False):  # its dense checks refuse grouped query heads, enable_gqa or not
        return False
    dtypes = (torch.float16, torch.float32, torch.bfloat16) if cc >= (8, 0) else (torch.float16, torch.float32)
    if c.q.dtype not in dtypes:
        return False
    a = gemm_alignment(cc, c.q.dtype in _HALF)
    dq, dv = c.q.shape[-1], c.v.shape[-1]
    if dq != c.k.shape[-1] or dq % a or dv % a:
        return False
    return cc < (8, 0) or all(t.storage_offset() % a == 0 for t in (c.q, c.k, c.v))


def choose_backend(card: GpuSpec, c: Call) -> str:
    """flash | efficient | math, as PyTorch's select_sdp_backend would pick on `card` (default priority order; the
    backends torch.backends.cuda's switches, sdpa_kernel, turned off are skipped as on CUDA)."""
    if can_use_flash(card, c):
        return "flash"
    if can_use_efficient(card, c):
        return "efficient"
    if not torch.backends.cuda.math_sdp_enabled():
        raise RuntimeError("No available kernel. Aborting execution. (as CUDA would say on "
                           f"{card.name}: the math backend is turned off and no fused one takes these inputs)")
    return "math"


def _round(n: int, m: int) -> int:
    return -(-n // m) * m


def _lse_shape(backend: str, q: torch.Tensor, needs_grad: bool) -> tuple[int, ...]:
    b, h, t = q.shape[0], q.shape[1], q.shape[2]
    if backend == "flash":
        return (b, h, t)
    return (b, h, _round(t, 32) if needs_grad else 0)


def _scratch(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             split_keys: bool) -> list[torch.Tensor]:
    """What the backward kernel allocates besides the gradients, for the length of the kernel. `split_keys`: the
    efficient kernel accumulates grad_q in fp32 (kNeedsAccumGradQ: fp16/bf16 outputs, or keys split across blocks,
    which sm70 and newer do)."""
    b, h, t, d = q.shape
    f32 = {"dtype": torch.float32, "device": q.device}
    if backend == "flash":
        d_round = _round(d, 32) if d <= 192 else 256
        out = [torch.empty(b, h, _round(t, 128), **f32), torch.empty(b, _round(t, 128), h, d_round, **f32)]
        if k.shape[1] != h:  # grouped heads: dk, dv made for every query head, then summed per group
            out += [torch.empty(b, k.shape[2], h, k.shape[-1], dtype=k.dtype, device=k.device),
                    torch.empty(b, v.shape[2], h, v.shape[-1], dtype=v.dtype, device=v.device)]
        return out
    out = [torch.empty(b, h, t, **f32)]
    if q.dtype in _HALF or split_keys:
        out.append(torch.empty(b, h, t, d, **f32))
    return out


def _math(c: Call) -> torch.Tensor:
    gqa = {"enable_gqa": True} if c.gqa else {}  # (a keyword torch 2.4's math backend has not got)
    return torch.ops.aten._scaled_dot_product_attention_math(
        c.q, c.k, c.v, c.mask, c.dropout, c.causal, None, scale=c.scale, **gqa)[0]


def _options(c: Call) -> tuple:
    return c.dropout, c.causal, c.scale, c.gqa


def _attention_elements(c: Call) -> int:
    return c.q.shape[0] * c.q.shape[1] * c.q.shape[2] * c.k.shape[-2]


def _math_run(options: tuple):
    """The math backend on inputs (q, k, v, mask) with these options (for attention_shapes on meta tensors)."""
    return lambda q, k, v, mask: _math(Call(q, k, v, mask, *options))


def _fused_values(c: Call) -> torch.Tensor:
    """The output a fused kernel returns, with the CPU's values; on valueless fake inputs only its layout
    (attention_shapes), without running the composite."""
    if valueless((c.q, c.k, c.v, c.mask), c.dropout, _attention_elements(c)):
        layouts = result_layouts(_math_run(_options(c)), (c.q, c.k, c.v, c.mask), _options(c))
        if layouts is not None:
            return made(layouts, c.q.device)[0]
    return _math(c).detach()


def _fused_grads(ins: list, options: tuple, dout: torch.Tensor) -> list:
    """The gradients of the inputs `ins` (q, k, v, mask; None or not requiring one: None) given the output's."""
    wanted = [t for t in ins if t is not None and t.requires_grad]
    c = Call(*ins, *options)
    layouts = None
    if valueless((*ins, dout), c.dropout, _attention_elements(c)):
        layouts = result_layouts(_math_run(options), tuple(ins), options, grad_of=dout)
    if layouts is not None:
        grads = iter(made(layouts, dout.device))
    else:
        out = _math(c)
        grads = iter(torch.autograd.grad(out, wanted, dout) if wanted else ())
    return [next(grads) if t is not None and t.requires_grad else None for t in ins]


def _padded(t: torch.Tensor) -> torch.Tensor:
    """The flash kernel's copy of q, k, v or the output gradient with the head dim padded to a multiple of 8."""
    return F.pad(t, (0, _round(t.shape[-1], 8) - t.shape[-1]))


class _FusedAttention(torch.autograd.Function):
    """A flash or efficient kernel's memory with the CPU's values: see the module doc. It holds tensors only through
    save_for_backward, so saved-tensor hooks (the offload-activations lever) see all of them. Flash pads a head dim
    that is not a multiple of 8: padded copies of q, k, v for the kernel's length, an output and gradients stored
    padded (what is returned is their unpadded view)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, backend: str, options: tuple, needs_grad: bool, split_keys: bool):
        ctx.backend, ctx.options, ctx.split_keys = backend, options, split_keys  # options: (dropout, causal, ...)
        ctx.rng = torch.get_rng_state() if options[0] else None
        pad = backend == "flash" and q.shape[-1] % 8 != 0
        copies = [_padded(t) for t in (q, k, v)] if pad else []  # the kernel's inputs, freed once it returns
        with untracked():
            out = _fused_values(Call(q, k, v, mask, *options))
            stored = _padded(out) if pad else out
        adopt(stored)
        lse = torch.empty(_lse_shape(backend, q, needs_grad), dtype=torch.float32, device=q.device)
        del copies
        # the output's storage last, returned as a tensor of its own: checkpointing's recomputation packs a tensor
        # that aliases the output last, and compares the saved tensors in order
        ctx.save_for_backward(q, k, v, mask, lse, stored)
        return stored[..., :out.shape[-1]].detach()

    @staticmethod
    def backward(ctx, dout):
        q, k, v, mask, _, _ = ctx.saved_tensors  # (lse, out: kept for their memory)
        pad = ctx.backend == "flash" and q.shape[-1] % 8 != 0
        scratch = _scratch(ctx.backend, q, k, v, ctx.split_keys)
        scratch += [_padded(t) for t in (q, k, v, dout)] if pad else []
        with untracked(), torch.enable_grad(), torch.random.fork_rng(devices=[], enabled=ctx.rng is not None):
            if ctx.rng is not None:
                torch.set_rng_state(ctx.rng)  # the forward's dropout mask again
            ins = [t.detach().requires_grad_(t.requires_grad) if t is not None else None for t in (q, k, v, mask)]
            result = _fused_grads(ins, ctx.options, dout)
            stored = [_padded(g) if pad and g is not None and i < 3 else g for i, g in enumerate(result)]
        adopt(*[g for g in stored if g is not None])
        del scratch
        result = [None if g is None else g[..., :r.shape[-1]] for g, r in zip(stored, result, strict=True)]
        return (*result, None, None, None, None)


def _efficient_mask(c: Call) -> torch.Tensor | None:
    """The mask as the efficient kernel takes it (preprocess_mask): a boolean one as an additive float mask of q's
    dtype, a new tensor; one whose strides are not aligned to 8 elements (or whose last stride is not 1) copied with
    the last dim padded to a multiple of 8, of which a view of the unpadded part is used."""
    mask = c.mask
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        zero, ninf = (torch.full((), x, dtype=c.q.dtype, device=mask.device) for x in (0.0, -math.inf))
        mask = torch.where(mask, zero, ninf)
    if mask.stride(-1) != 1 or any(s % 8 for s in mask.stride()[:-1]):
        last = mask.shape[-1]
        mask = F.pad(mask, (0, _round(last, 8) - last))[..., :last]
    return mask


# what the kernels chosen since the last kernel_notes() would not tell a user by itself -> the attention's dtype
_SEEN: dict[str, torch.dtype] = {}
_ATTENTION_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "bf16-true": torch.bfloat16, "fp16": torch.float16}


def kernel_notes(precision: str | None = None) -> tuple[str, ...]:
    """The notes on kernel choices made since the last call (and forget them): those of a plan of `precision`'s
    attention alone where it is given (an fp32 rung's choice says nothing of a bf16 plan)."""
    want = _ATTENTION_DTYPE.get(precision) if precision is not None else None
    notes = tuple(n for n, dtype in _SEEN.items() if want is None or dtype == want)
    _SEEN.clear()
    return notes


def _grouped_note(card: GpuSpec, c: Call) -> None:
    """Math taken only because the heads are grouped (efficient would take the same call with equal heads)."""
    if not c.gqa or c.q.dim() != 4 or c.k.dim() != 4:
        return
    hq, hk = c.q.shape[1], c.k.shape[1]
    if hq == hk or hq % hk:
        return
    b, _, t, _ = c.k.shape
    wide = [x[:, :1].expand(b, hq, t, x.shape[-1]) for x in (c.k, c.v)]
    if not can_use_efficient(card, Call(c.q, *wide, c.mask, c.dropout, c.causal, c.scale)):
        return
    kind = next((k for k, d in _ATTENTION_DTYPE.items() if d == c.q.dtype), str(c.q.dtype))  # (bf16 before bf16-true)
    _SEEN[f"on {card.name}, {kind} attention with grouped query heads ({hq} query, {hk} key/value) runs PyTorch's "
          "math kernel, which keeps each layer's (batch, heads, context, context) attention matrix: the "
          "memory-efficient kernel takes no grouped heads" + ("" if c.q.dtype in _HALF else
                                                              ", and flash only fp16/bf16 (the amp rung)") +
          (". In a transformers model a padded batch (a 0 in its attention_mask) takes less: the key/value heads are "
           "repeated for the memory-efficient kernel, so an unpadded batch is the worst case" if c.mask is None
           else "")] = c.q.dtype


def attention(card: GpuSpec, c: Call) -> torch.Tensor:
    """SDPA on `card`'s backend (inputs as CUDA autocast, where it runs, cast them already: cuda_autocast.py)."""
    backend = choose_backend(card, c)
    if backend == "math":
        _grouped_note(card, c)
        return _math(c)
    mask = _efficient_mask(c) if backend == "efficient" else None
    return _FusedAttention.apply(c.q, c.k, c.v, mask, backend, (c.dropout, c.causal, c.scale, c.gqa), c.needs_grad,
                                 card.compute_capability >= (7, 0))
