"""bitsandbytes' 4-bit weights, as a model file or a Hugging Face folder declares them: a `BitsAndBytesConfig(
load_in_4bit=True, ...)` defined in the model file (any module-level name), or a config.json whose
`quantization_config` is bitsandbytes' 4-bit one (a checkpoint saved quantized). QLoRA as transformers, PEFT and
litgpt (`bnb.nf4`, `bnb.nf4-dq`) run it: the model is 4-bit on every rung, every frozen Linear but the output head
(or, where the config lists `llm_int8_skip_modules`, but those: `skipped`; an empty list, none).

The layout is bitsandbytes' own (`bitsandbytes.functional.quantize_4bit`, blocks of 64): the weight packed two
elements a byte, ((n+1)//2, 1) uint8; its 16-value code in fp32; an fp32 absmax a block, or with double quantization
(`bnb_4bit_use_double_quant`) a uint8 absmax a block, an fp32 scale per 256 of those, their mean and the 256-value
map in fp32. Each layer keeps them as buffers, so they move with the model (bitsandbytes moves the same tensors with
its weight, each layer its own copy of the maps).

In training the weight is dequantized at each use, in forward and again in backward: `dequantize_4bit` makes the
whole (out, in) weight in its dtype, then F.linear; with double quantization the absmax is dequantized first (fp32,
a value a block). That is bitsandbytes' `MatMul4Bit` (and its CUDA kernel's choice for more than 1536 rows since
0.50: a micro-batch of fewer tokens may take its fused kernel, which makes no dequantized weight). Every device runs
bitsandbytes' own dequantization (its fake kernels on the fake device); on the cpu and cuda the quantization is its
own too, on the fake device made here with the same shapes (its double quantization reads values)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .nf4 import as_linear_class, forward_subclass, frozen_linears, is_conv1d

BLOCK, BLOCK2 = 64, 256  # bitsandbytes' 4-bit block (QLoRA's) and its double quantization's
BUFFERS = ("bnb_absmax", "bnb_code", "bnb_offset", "bnb_absmax2", "bnb_code2")


@dataclass(frozen=True)
class Bnb4bit:
    """What a BitsAndBytesConfig(load_in_4bit=True) says of the layout (fp4 stores as nf4 does)."""
    quant_type: str = "fp4"  # (transformers' default)
    double_quant: bool = False
    skip: tuple[str, ...] | None = None  # llm_int8_skip_modules (None: not given, the output head alone is kept, as
    # transformers keeps it; an empty list given: every frozen Linear, the head too, as transformers quantizes)
    source: str = "its BitsAndBytesConfig"  # where it was declared, as the notes say it
    compute_dtype: torch.dtype | None = None  # bnb_4bit_compute_dtype, where 16-bit (fp32, the default: None)

    @property
    def name(self) -> str:
        return f"bitsandbytes {self.quant_type}{' (double-quantized)' if self.double_quant else ''}"


def declared(module) -> Bnb4bit | None:
    """The 4-bit layout a model file's module (or a Hugging Face model's hooks object) declares, or None."""
    for get, source in _bitsandbytes_configs(module):
        if get("load_in_4bit", get("_load_in_4bit", False)):
            skip = get("llm_int8_skip_modules", None)
            compute = str(get("bnb_4bit_compute_dtype", None)).removeprefix("torch.")
            return Bnb4bit(str(get("bnb_4bit_quant_type", "fp4")), bool(get("bnb_4bit_use_double_quant", False)),
                           tuple(str(s) for s in skip) if skip is not None else None, source,
                           {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(compute))
    return None


def _bitsandbytes_configs(module) -> list[tuple]:
    """(a getter (key, default), where it came from) for each bitsandbytes quantization config the module declares:
    a BitsAndBytesConfig among its names, else its `config.quantization_config` (config.json's dict, or the object
    transformers made of it)."""
    found = [(q, "its BitsAndBytesConfig") for q in getattr(module, "__dict__", {}).values()
             if type(q).__name__ == "BitsAndBytesConfig"]
    config = getattr(module, "config", None)
    if not found and config is not None and not isinstance(config, type) and \
            getattr(config, "quantization_config", None):
        found = [(config.quantization_config, "config.json's quantization_config")]
    getters = [(q.get if isinstance(q, dict) else (lambda k, d=None, q=q: getattr(q, k, d)), source)
               for q, source in found]
    return [(get, source) for get, source in getters
            if str(get("quant_method", "bitsandbytes")).split(".")[-1].lower() in ("bitsandbytes", "bits_and_bytes")]


OLDEST = (0, 47)  # the first bitsandbytes with 4-bit kernels on the CPU and on fake tensors (the finetune extra's)


def too_old() -> str | None:
    """The installed bitsandbytes' version where it is older than OLDEST, else None. Before it, bitsandbytes has no
    4-bit kernels to run on the simulated devices, and before 0.43.2 its 4-bit matmul also kept each layer's input
    for backward (dropped by its #1270), which the layout here does not hold."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("bitsandbytes")
    except PackageNotFoundError:  # (importable without its metadata: a source tree on the path; taken as it is)
        return None
    numbers = tuple(int(n) for n in re.findall(r"\d+", found)[:2])
    return found if numbers < OLDEST else None


def library():
    """bitsandbytes' functional module; ImportError where it is not installed. Its first import makes tensors
    (its maps): real ones, outside any fake mode and tracker, as an import before the search makes them."""
    import sys

    if "bitsandbytes.functional" not in sys.modules:
        from torch.utils._python_dispatch import _disable_current_modes

        from ..memory.tracker import untracked

        with _disable_current_modes(), untracked():
            import bitsandbytes.functional  # noqa: F401
    return sys.modules["bitsandbytes.functional"]


def quantize_declared(model: nn.Module, spec: Bnb4bit, computes: bool = True) -> int:
    """Store each frozen Linear weight (but the skipped) in bitsandbytes' layout; returns how many."""
    bnbf = library()
    chosen = set(map(id, frozen_linears(model, whole_blocks=False, keep_head=spec.skip is None)))
    layers = [m for name, m in model.named_modules() if id(m) in chosen and not skipped(name, spec.skip or ())]
    for m in layers:
        conv1d = is_conv1d(m)
        w = m.weight.detach().t().contiguous() if conv1d else m.weight.detach()
        if spec.compute_dtype is not None and w.dtype == torch.float32:  # loaded in it, as the guides load it
            w = w.to(spec.compute_dtype)
        if computes:
            packed, state = bnbf.quantize_4bit(w, blocksize=BLOCK, compress_statistics=spec.double_quant,
                                              quant_type=spec.quant_type)
            tensors = _stored(state)
        else:
            packed, tensors = _made(w, spec.double_quant)
        m.weight = nn.Parameter(packed, requires_grad=False)
        for name, t in zip(BUFFERS, tensors, strict=True):
            m.register_buffer(name, t, persistent=False)
        m.bnb_4bit = (spec.quant_type, tuple(w.shape), w.dtype, spec.compute_dtype)
        if conv1d:
            m.__class__ = as_linear_class(type(m))
        m.__class__ = _bnb_class(type(m))
        del w
    return len(layers)


def skipped(name: str, skip: tuple[str, ...]) -> bool:
    """llm_int8_skip_modules as transformers matches them: the module's own name (PEFT's wrapping, base_model.model.
    and .base_layer, taken off) equal to an entry, under it (a prefix at a dot), ending with it, or matching it as a
    regular expression."""
    name = name.removeprefix("base_model.model.").removesuffix(".base_layer")
    for s in skip:
        if f".{s}." in f".{name}.":  # (the name itself, a prefix or a suffix at a dot, or a part between dots)
            return True
        try:
            if re.fullmatch(s, name):
                return True
        except re.error:
            pass
    return False


def _stored(state) -> tuple[torch.Tensor | None, ...]:
    """The tensors bitsandbytes' QuantState keeps, in BUFFERS' order (None where it has none)."""
    if state.nested:
        return state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code
    return state.absmax, state.code, None, None, None


def _made(w: torch.Tensor, double_quant: bool):
    """quantize_4bit's stored tensors, made with its shapes and dtypes (the fake device: no values to quantize)."""
    n, device = w.numel(), w.device
    blocks = math.ceil(n / BLOCK)
    packed = torch.empty((n + 1) // 2, 1, dtype=torch.uint8, device=device)
    code = torch.empty(16, dtype=torch.float32, device=device)
    if not double_quant:
        return packed, (torch.empty(blocks, dtype=torch.float32, device=device), code, None, None, None)
    return packed, (torch.empty(blocks, dtype=torch.uint8, device=device), code,
                    torch.empty((), dtype=torch.float32, device=device),
                    torch.empty(math.ceil(blocks / BLOCK2), dtype=torch.float32, device=device),
                    torch.empty(256, dtype=torch.float32, device=device))


def dequantized(m: nn.Module) -> torch.Tensor:
    """The layer's whole weight, (out, in) in its dtype, by bitsandbytes' dequantize_4bit (as its MatMul4Bit)."""
    bnbf = library()
    quant_type, shape, dtype, _ = m.bnb_4bit
    state2 = None
    if m.bnb_offset is not None:
        state2 = bnbf.QuantState(absmax=m.bnb_absmax2, code=m.bnb_code2, blocksize=BLOCK2, dtype=torch.float32)
    state = bnbf.QuantState(absmax=m.bnb_absmax, shape=torch.Size(shape), dtype=dtype, blocksize=BLOCK,
                            code=m.bnb_code, quant_type=quant_type, offset=m.bnb_offset, state2=state2)
    return bnbf.dequantize_4bit(m.weight, state)


class _Linear4bit(torch.autograd.Function):
    """F.linear with a bitsandbytes 4-bit weight, dequantized in forward and again in backward (nothing of it saved);
    the weight is frozen; a trained bias gets its gradient."""

    @staticmethod
    def forward(ctx, x, bias, m):
        ctx.m, ctx.bias_dtype = m, None if bias is None else bias.dtype
        return F.linear(x, dequantized(m).to(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        grad_x = grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0, dtype=ctx.bias_dtype)
        if ctx.needs_input_grad[0]:
            grad_x = torch.matmul(grad, dequantized(ctx.m).to(grad.dtype))
        return grad_x, grad_bias, None


def _forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' Linear4bit.forward: the input (and bias) in the compute dtype where one is set, the output back
    in the input's dtype."""
    compute, given = self.bnb_4bit[3], x.dtype
    bias = self.bias
    if compute is not None:
        x = x.to(compute)
        bias = None if bias is None else bias.to(compute)
    return _Linear4bit.apply(x, bias, self).to(given)


def _bnb_class(cls: type) -> type:
    """The subclass of a Linear class whose forward runs the 4-bit weight."""
    return forward_subclass(cls, "Bnb4bit", _forward, globals())


def is_bnb_4bit(m: nn.Module) -> bool:
    """A layer in bitsandbytes' 4-bit layout: made here, or bitsandbytes' own Linear4bit (a checkpoint loaded so)."""
    return hasattr(m, "bnb_4bit") or type(m).__name__ == "Linear4bit"


def loading_hint(error: BaseException) -> str:
    """A hint for a build_model() that loads its model 4-bit itself (from_pretrained(..., quantization_config=...)):
    bitsandbytes' Params4bit cannot wrap the simulated devices' tensors."""
    if "Params4bit" not in str(error) and "Linear4bit" not in str(error):
        return ""
    return (" (build_model() loads its weights in 4 bits: return the model unquantized and define the "
            "BitsAndBytesConfig at the file's top level; oomtune stores the frozen weights as it says)")


def declared_note(model_file) -> tuple[str, ...]:
    """What the searches say of a model that declares 4-bit weights, or 8-bit ones (not modelled); else nothing."""
    spec = declared(model_file.module)
    if spec is None:
        eight = any(get("load_in_8bit", get("_load_in_8bit", False))
                    for get, _ in _bitsandbytes_configs(model_file.module))
        return ((f"{model_file.label}: its BitsAndBytesConfig loads 8-bit weights (LLM.int8), which oomtune does not "
                 "model: the weights are estimated as built (use load_in_4bit, or --levers nf4)",) if eight else ())
    kept = ("but the output head" if spec.skip is None else f"but {', '.join(spec.skip)}" if spec.skip else
            "the output head too: its skip list is empty")
    return (f"{model_file.label}: {spec.source} stores every frozen Linear weight ({kept}) in {spec.name}, "
            "bitsandbytes' layout, on every rung; dequantized whole at each use in forward and backward "
            "(bitsandbytes' choice for more than 1536 tokens a micro-batch)",)
