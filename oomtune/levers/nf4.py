"""4-bit frozen weights (QLoRA): the weight of every nn.Linear that is not trained (PEFT LoRA's base layers) stored
as torchao's NF4Tensor (4 bits an element in blocks of 64, each block's scale in 8 bits, those in blocks of 256),
dequantized per use by torchao's linear_nf4 (the F.linear of an NF4 weight). A trained weight is never quantized.
It runs on every device: on the fake one too (torchao's NF4 works under FakeTensorMode).

transformers' Conv1D (GPT-2's projections: x @ W + b, W stored (in, out)) is a Linear with its weight transposed:
its weight is stored as the Linear's (out, in) in NF4 and its forward becomes F.linear, as bitsandbytes'
4-bit loading in transformers treats it."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from ..memory.made_nf4 import hook, made_to_nf4, nf4_tensor

NF4_BLOCK, SCALER_BLOCK = 64, 256  # torchao's defaults (to_nf4)


def frozen_linears(model: nn.Module, whole_blocks: bool = True, keep_head: bool = True) -> list[nn.Module]:
    """The Linear (and Conv1D) layers whose weight is frozen and can be stored in NF4 (torchao's: whole blocks of
    64 and of 256 scalers; bitsandbytes' takes any size, `whole_blocks` False), but not a Hugging Face model's
    output head: QLoRA keeps it as it is (bitsandbytes' and torchtune's QLoRA both do), and dequantizing a
    vocabulary-sized matrix holds ~16 bytes an element of scratch in backward (`keep_head` False: a BitsAndBytesConfig
    that lists the modules it skips quantizes the head too, as transformers does)."""
    head = _output_head(model)
    if not keep_head and head is not None and not _tied(model, head):
        head = None
    return [m for m in model.modules()
            if (computes_f_linear(m) or is_conv1d(m)) and m is not head and not m.weight.requires_grad
            and (not whole_blocks or _blocks_fit(m.weight.numel()))]


def computes_f_linear(m: nn.Module) -> bool:
    """An nn.Linear whose forward is nn.Linear's, F.linear, which torchao's NF4 weight dispatches to linear_nf4. A
    subclass with a forward of its own is left as it is: transformers' FalconLinear computes x @ W.T, and an NF4
    weight has no transpose ("NF4Tensor dispatch: attempting to run aten.permute.default")."""
    return isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward


def is_conv1d(m: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2, GPT-Neo's relatives): a Linear whose weight is stored transposed, (in, out)."""
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and getattr(m, "weight", None) is not None


def _as_linear(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A Conv1D's forward once its weight is the Linear's (out, in): the same x @ W + b."""
    return F.linear(x, self.weight, self.bias)


def as_linear_class(cls: type) -> type:
    """The subclass of a Conv1D class whose forward is F.linear."""
    return forward_subclass(cls, "AsLinearNF4", _as_linear, globals())


def forward_subclass(cls: type, suffix: str, forward, home: dict) -> type:
    """The subclass of `cls` whose forward is `forward`, made once per class and kept in `home` (its module's
    globals: a pickled model finds it there). Swapping a layer's class, not binding a forward on the instance, makes
    no reference cycle: the model is freed as soon as it is dropped."""
    name = f"{cls.__name__}{suffix}"
    made = home.get(name)
    if made is None or made.__bases__ != (cls,):
        made = type(name, (cls,), {"forward": forward, "__module__": home["__name__"], "__qualname__": name})
        home[name] = made
    return made


def _output_head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)  # transformers' models (and PEFT's, which forward it)
    try:
        return get() if callable(get) else None
    except (AttributeError, NotImplementedError, TypeError):
        return None


def _tied(model: nn.Module, head: nn.Module) -> bool:
    """The head's weight is the input embedding's (tied): never quantized, as transformers keeps tied weights."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        embedding = get() if callable(get) else None
    except (AttributeError, NotImplementedError, TypeError):
        return False
    return embedding is not None and getattr(embedding, "weight", None) is getattr(head, "weight", None)


def _blocks_fit(numel: int) -> bool:
    return numel % NF4_BLOCK == 0 and (numel // NF4_BLOCK) % SCALER_BLOCK == 0


def library_to_nf4():
    """torchao's to_nf4 (its module moved between releases); ImportError where torchao is missing. Its NF4 weights'
    dequantization on fake tensors is made from then on (memory/made_nf4.hook)."""
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    except ImportError:
        from torchao.dtypes.nf4tensor import to_nf4
    hook(sys.modules[to_nf4.__module__])
    return to_nf4


def quantize_frozen(model: nn.Module, computes: bool = True) -> int:
    """Replace each frozen Linear weight by its NF4 form, in order; returns how many were replaced.

    Where tensors hold no values (`computes` False: the fake device), torchao's quantizer runs only on the first
    weight of each shape and dtype, and `nf4_like` makes the others' NF4 tensors without it (its hundreds of ops
    a weight compute nothing there). The memory is the same: what a quantization stores and its scratch depend on
    the shape alone, and the scratch's peak for a shape is at its first weight, the one with the most unquantized
    weights still alive around it (each quantized weight frees its original). That first one is made from the
    process's first quantization of its kind (memory/made_nf4.made_to_nf4: the same storages, in the same order)."""
    to_nf4 = library_to_nf4()
    layers = frozen_linears(model)
    seen: set[tuple] = set()
    for m in layers:
        conv1d = is_conv1d(m)
        w = m.weight.detach().t().contiguous() if conv1d else m.weight.detach()  # a Conv1D's: the Linear's layout
        key = (tuple(w.shape), w.dtype)
        if computes:
            quantized = to_nf4(w, NF4_BLOCK, SCALER_BLOCK)
        else:
            quantized = made_to_nf4(to_nf4, w, NF4_BLOCK, SCALER_BLOCK) if key not in seen else nf4_like(w)
        seen.add(key)
        m.weight = nn.Parameter(quantized, requires_grad=False)
        if conv1d:
            m.__class__ = as_linear_class(type(m))
        del w
    return len(layers)


def nf4_like(weight: torch.Tensor, block_size: int = NF4_BLOCK, scaler_block_size: int = SCALER_BLOCK):
    """torchao's NF4Tensor of `weight`'s shape, its tensors made empty as to_nf4 would store them: 4 bits an element,
    an int8 scale per block; in the weight's own dtype, a factor per block of scales, their mean and the 16 NF4
    values."""
    n, device, dtype = weight.numel(), weight.device, weight.dtype
    blocks = n // block_size
    scaler_blocks = blocks // scaler_block_size
    # as to_nf4 makes it: one factor per block of scales, taken from a (blocks, scaler_block_size) tensor (a single
    # block keeps that tensor's storage: contiguous() copies only a strided column)
    factor = torch.empty(scaler_blocks, scaler_block_size, dtype=dtype, device=device)[:, 0]
    factor = factor.view(scaler_blocks).contiguous()
    inner = [torch.empty(blocks, dtype=torch.int8, device=device), factor, torch.empty((), dtype=dtype, device=device),
             torch.empty(n // 2, dtype=torch.uint8, device=device), torch.empty(16, dtype=dtype, device=device)]
    return nf4_tensor(sys.modules[library_to_nf4().__module__], weight.detach(), block_size, scaler_block_size, inner)


