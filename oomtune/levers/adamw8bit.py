"""AdamW with 8-bit moments.

On cuda the library's own: torchao's `AdamW8bit` (or bitsandbytes' where torchao is missing). Its step is a
`torch.compile`d kernel, which cannot run under the simulated devices' TorchDispatchMode, so the `cpu` and `fake`
devices run `BlockwiseAdamW8bit`: the same state layout as torchao's (per moment a byte per element and an fp32
scale per block of 256; tensors under 4096 elements, or not a whole number of blocks, keep plain moments in the
parameter's dtype, as torchao's `zeros_like(p)`: bf16 for a bf16 parameter, fp32 for an fp32 one) and
the same update, in eager ops. Its codes are a dynamic (logarithmic) map of each block's values over the
block's largest magnitude: 7 bits of magnitude and a sign for the first moment, 8 bits for the second.

Its step works through a parameter in chunks of CHUNK_BLOCKS blocks, so its scratch is bounded (about 30 bytes
per element of a chunk) however large the parameter, as a fused kernel's is."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .fake_scratch import FakeScratch

BLOCK = 256  # elements per scale (torchao's block_size)
MIN_QUANT = 4096  # smaller tensors keep plain moments in their own dtype (torchao's min_quant_size)
CHUNK_BLOCKS = 1 << 16  # blocks per chunk of the step: 16M elements
SIGNED_DECADES, UNSIGNED_DECADES = 6.0, 7.0  # the codes' range below each block's largest magnitude


def quantizes(elements: int) -> bool:
    """Does a parameter of this many elements get 8-bit moments (else plain ones, in its dtype)?"""
    return elements >= MIN_QUANT and elements % BLOCK == 0


def _codebook(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the 256 values a code stands for, ascending; the midpoints between neighbours) of a block's values over its
    largest magnitude: logarithmically spaced, so small moments keep their relative precision. Real CPU tensors
    outside every mode: this module is first imported where a lever is first used, which can be inside a simulated
    device's measurement (fake tensors, counted as the device's: they would outlive it, and be fake ever after)."""
    with _disable_current_modes(), torch.device("cpu"):
        if signed:  # 128 negative magnitudes and 128 positive ones, 1e-6 .. 1
            mag = torch.pow(10.0, torch.arange(128, dtype=torch.float64) * (SIGNED_DECADES / 127) - SIGNED_DECADES)
            values = torch.cat([-mag.flip(0), mag])
        else:  # 1e-7 .. 1
            values = torch.pow(10.0, torch.arange(256, dtype=torch.float64) * (UNSIGNED_DECADES / 255)
                               - UNSIGNED_DECADES)
        values = values.float()
        return values, (values[1:] + values[:-1]) / 2


_CODEBOOKS = {signed: _codebook(signed) for signed in (True, False)}


def quantize(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 of x's shape, one fp32 scale per block of 256) of a tensor of whole blocks: each value's nearest
    code, found among the midpoints (torch.bucketize), as torchao's quantizer does."""
    blocks = x.reshape(-1, BLOCK).float()
    scale = blocks.abs().amax(dim=1).clamp_min(1e-30)
    codes = torch.bucketize(blocks / scale[:, None], _CODEBOOKS[signed][1], out_int32=True)
    return codes.to(torch.uint8).reshape(x.shape), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 values, blocks of 256 as rows."""
    values = _CODEBOOKS[signed][0]
    return values[codes.reshape(-1, BLOCK).int()].mul_(scale[:, None])


def _store(codes: torch.Tensor, scale: torch.Tensor, moment: torch.Tensor, signed: bool) -> None:
    """Quantize `moment` into its codes and scales, in place."""
    new_codes, new_scale = quantize(moment, signed)
    codes.copy_(new_codes)
    scale.copy_(new_scale)


class BlockwiseAdamW8bit(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments) whose moments are stored in 8 bits. Defaults are
    torchao's AdamW8bit's (and torch's AdamW's): betas (0.9, 0.999), eps 1e-8, weight decay 0.01."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.fake_scratch = FakeScratch()  # on fake tensors, chunks made from the first of their kind

    def _init_state(self, p: torch.Tensor) -> dict:
        if not quantizes(p.numel()):
            return {"step": 0, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        blocks = p.numel() // BLOCK
        state = {"step": 0}
        for name in ("exp_avg", "exp_avg_sq"):  # zero moments: the smallest code, at a zero scale
            state[f"{name}_codes"] = torch.zeros_like(p, dtype=torch.uint8)
            state[f"{name}_scale"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        return state

    def make_state(self) -> None:
        """The state a first step makes for every parameter, without the step (zero moments)."""
        for group in self.param_groups:
            for p in group["params"]:
                if not self.state[p]:
                    self.state[p].update(self._init_state(p))

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, keeping the saved dtypes: torch casts every floating-point state tensor to its parameter's dtype,
        which would make a bf16 parameter's fp32 scales bf16 (the step then mixes dtypes and fails)."""
        saved = [{k: v for k, v in state_dict["state"].get(i, {}).items() if torch.is_tensor(v)}
                 for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for p, tensors in zip(params, saved, strict=True):
            for k, v in tensors.items():
                self.state[p][k] = v.to(p.device, copy=True)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(self._init_state(p))
                state["step"] += 1
                if "exp_avg" in state:
                    self._update(p.view(1, -1), p.grad.view(1, -1), state["exp_avg"].view(1, -1),
                                 state["exp_avg_sq"].view(1, -1), group, state["step"])
                else:
                    self._step_quantized(p, state, group)
        return loss

    def _step_quantized(self, p: torch.Tensor, state: dict, group: dict) -> None:
        rows = p.view(-1, BLOCK)
        grad = p.grad.view(-1, BLOCK)
        codes_m, codes_v = state["exp_avg_codes"].view(-1, BLOCK), state["exp_avg_sq_codes"].view(-1, BLOCK)
        scale_m, scale_v = state["exp_avg_scale"], state["exp_avg_sq_scale"]
        n = rows.shape[0]
        for a in range(0, n, CHUNK_BLOCKS):
            b = min(a + CHUNK_BLOCKS, n)
            part = (lambda x: x) if b - a == n else (lambda x, a=a, b=b: x[a:b])  # one chunk: no slicing
            kind = self.fake_scratch.kind(p, b - a, b - a == n)  # (fake: made from the first of its kind)
            self.fake_scratch.run(kind, lambda part=part: self._chunk(part, rows, grad, (codes_m, scale_m),
                                                                      (codes_v, scale_v), group, state["step"]),
                                  (p, codes_m, scale_m, codes_v, scale_v))

    def _chunk(self, part, rows, grad, moment1, moment2, group: dict, step: int) -> None:
        """One chunk of rows: both moments dequantized, the update, the moments stored back (the step's scratch is
        one chunk's: each is freed before the next)."""
        m = dequantize(part(moment1[0]), part(moment1[1]), signed=True)
        v = dequantize(part(moment2[0]), part(moment2[1]), signed=False)
        self._update(part(rows), part(grad), m, v, group, step)
        _store(part(moment1[0]), part(moment1[1]), m, signed=True)
        _store(part(moment2[0]), part(moment2[1]), v, signed=False)

    @staticmethod
    def _update(p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, group: dict,
                step: int) -> None:
        """One AdamW update of p (any dtype) with moments m and v, in place, computed in fp32 (a small bf16
        parameter's bf16 moments too, as torchao's step computes them)."""
        if m.dtype != torch.float32:
            m32, v32 = m.float(), v.float()
            BlockwiseAdamW8bit._update(p, grad, m32, v32, group, step)
            m.copy_(m32)
            v.copy_(v32)
            return
        beta1, beta2 = group["betas"]
        lr, eps = group["lr"], group["eps"]
        g = grad.float()
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v / (1 - beta2 ** step)).sqrt_().add_(eps)
        new = p.float().mul_(1 - lr * group["weight_decay"]).addcdiv_(m, denom, value=-lr / (1 - beta1 ** step))
        p.copy_(new)


def library_adamw8bit():
    """The 8-bit AdamW class a CUDA run uses: torchao's, else bitsandbytes'; None where neither is installed."""
    try:
        from torchao.optim import AdamW8bit

        return AdamW8bit
    except ImportError:
        pass
    try:
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit
    except ImportError:
        return None

