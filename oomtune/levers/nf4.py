"""4-bit frozen weights (QLoRA): the weight of every nn.Linear that is not trained (PEFT LoRA's base layers) stored
as torchao's NF4Tensor (4 bits an element in blocks of 64, each block's scale in 8 bits, those in blocks of 256),
dequantized per use by torchao's linear_nf4 (the F.linear of an NF4 weight). A trained weight is never quantized.
It runs on every device: on the fake one too (torchao's NF4 works under FakeTensorMode)."""

from __future__ import annotations

from torch import nn

NF4_BLOCK, SCALER_BLOCK = 64, 256  # torchao's defaults (to_nf4)


def frozen_linears(model: nn.Module) -> list[nn.Linear]:
    """The Linear layers whose weight is frozen and can be stored in NF4 (whole blocks of 64 and of 256 scalers)."""
    return [m for m in model.modules()
            if isinstance(m, nn.Linear) and not m.weight.requires_grad and _blocks_fit(m.weight.numel())]


def _blocks_fit(numel: int) -> bool:
    return numel % NF4_BLOCK == 0 and (numel // NF4_BLOCK) % SCALER_BLOCK == 0


def library_to_nf4():
    """torchao's to_nf4 (its module moved between releases); ImportError where torchao is missing."""
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    except ImportError:
        from torchao.dtypes.nf4tensor import to_nf4
    return to_nf4


def quantize_frozen(model: nn.Module) -> int:
    """Replace each frozen Linear weight by its NF4 form; returns how many were replaced."""
    to_nf4 = library_to_nf4()
    layers = frozen_linears(model)
    for m in layers:
        m.weight = nn.Parameter(to_nf4(m.weight.detach(), NF4_BLOCK, SCALER_BLOCK), requires_grad=False)
    return len(layers)


def is_nf4(t) -> bool:
    return type(t).__name__ == "NF4Tensor"
