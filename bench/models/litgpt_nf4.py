"""litgpt_finetune.py with `--quantize bnb.nf4`, for make bench-published: litgpt hands the model to Lightning
Fabric's BitsandbytesPrecision, which makes every nn.Linear a bitsandbytes 4-bit layer (NF4, blocks of 64, fp32
absmax, the bf16 compute dtype), the output layer and the frozen Linears inside litgpt's LoRA and adapter layers
too (the adapters are parameters, not Linears): a BitsAndBytesConfig with an empty skip list says the same.

The measured run had bitsandbytes 0.41.1, whose 4-bit matmul (MatMul4Bit) kept its input for backward wherever the
input needed a gradient (`ctx.tensors = (A, B)`), though only the weight's gradient, never computed for a 4-bit
weight, would use it; bitsandbytes 0.43.2 stopped keeping it ("fix QLoRA mem bug: delete useless buffered
activation", #1270). oomtune models the bitsandbytes installed (here a later one), so this file keeps each 4-bit
layer's input the way 0.41.1 did: held by the layer's node of the autograd graph until backward. Not modelled: the
bnb AdamW litgpt then builds (paged: its state lives outside PyTorch's allocator; torch's AdamW here, over a few
million parameters) and the StableEmbedding it swaps in (an embedding with a LayerNorm)."""

import litgpt_finetune
import torch
from litgpt_finetune import ARGS, DEFAULTS, loss, make_batch, optimizer  # noqa: F401 - the contract's names
from torch import nn
from transformers import BitsAndBytesConfig

bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False,
                         bnb_4bit_compute_dtype=torch.bfloat16, llm_int8_skip_modules=[])


class _KeptInput(torch.autograd.Function):
    """The layer's output as it is, its node holding the layer's input as bitsandbytes 0.41.1's MatMul4Bit held
    it (a plain attribute of its ctx)."""

    @staticmethod
    def forward(ctx, out, x):
        ctx.tensors = (x, None)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _keep_input(module, inputs, output):
    return _KeptInput.apply(output, inputs[0])


def build_model(**args):
    model = litgpt_finetune.build_model(**args)
    for m in model.modules():
        if isinstance(m, nn.Linear):  # (every one is made 4-bit)
            m.register_forward_hook(_keep_input)
    return model
