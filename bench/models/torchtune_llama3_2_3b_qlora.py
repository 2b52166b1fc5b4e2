"""Llama 3.2 3B QLoRA as torchtune's recipe builds it, for make bench-published (C6): LoRA r64/a128 on q, v, o and
the MLP (PEFT here), and the frozen base weights of the adapted projections alone in NF4 (torchao's to_nf4, blocks
of 64, as torchtune's QLoRA builders quantize their LoRA layers' bases): the un-adapted k_proj stays a bf16 Linear,
and so do the embedding and the output layer tied to it. oomtune's `--levers nf4` quantizes every frozen Linear but
the output head (as bitsandbytes' and litgpt's QLoRA do), k_proj too. Built in bf16 and then quantized, as torchtune
loads it. Shape: examples/hf/llama-3.2-3b's config, no weights."""

import json
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

CONFIG = Path(__file__).parents[2] / "examples" / "hf" / "llama-3.2-3b" / "config.json"
TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _to_nf4():
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    except ImportError:  # (older torchao)
        from torchao.dtypes.nf4tensor import to_nf4
    return to_nf4


def build_model():
    """On the meta device first, then each adapted projection made and quantized in turn, as torchtune's
    FrozenNF4Linear quantizes its weight as it is made: the device never holds the whole model in bf16 (torchtune
    then loads the checkpoint into the NF4 weights, weight by weight; here they keep their random values)."""
    config = LlamaConfig(**json.loads(CONFIG.read_text()))
    device = torch.get_default_device()
    with torch.device("meta"):
        model = get_peft_model(LlamaForCausalLM(config).to(torch.bfloat16),
                               LoraConfig(r=64, lora_alpha=128, lora_dropout=0.0, target_modules=TARGETS))
    to_nf4 = _to_nf4()
    for layer in [m for m in model.modules() if isinstance(m, LoraLayer)]:
        base = layer.get_base_layer()
        weight = torch.empty_like(base.weight, device=device).normal_(std=config.initializer_range)
        base.weight = nn.Parameter(to_nf4(weight, 64, 256), requires_grad=False)
        del weight
    for module in model.modules():  # the rest, as its class initialises it
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                made = torch.empty_like(p, device=device)
                nn.init.normal_(made, std=config.initializer_range) if made.dim() > 1 else nn.init.ones_(made)
                setattr(module, name, nn.Parameter(made, requires_grad=p.requires_grad))
    with torch.device(device):
        model.base_model.model.model.rotary_emb = LlamaRotaryEmbedding(config)
    for layer in [m for m in model.modules() if isinstance(m, LoraLayer)]:
        nn.init.zeros_(layer.lora_B["default"].weight)  # (a LoRA starts as the base model)
    model.tie_weights()
    return model


def make_batch(batch_size, context_length, device):
    vocab = json.loads(CONFIG.read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (batch_size, context_length), device=device)
    return {"input_ids": ids, "labels": ids}
