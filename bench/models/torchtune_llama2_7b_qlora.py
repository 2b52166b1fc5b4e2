"""Llama-2-7B QLoRA as torchtune's May 2024 recipe ran it (7B_qlora_single_device.yaml), for make bench-published:
LoRA r8/a16 on q, k, v, o and the MLP (PEFT here; `--levers nf4` stores the frozen base in NF4), the logits upcast
to fp32 by the model's own output layer (torchtune's TransformerDecoder: `self.output(h).float()`), and the loss
computed outside the model by nn.CrossEntropyLoss over those logits shifted by one token (a copy: the recipe's
`logits[..., :-1, :].contiguous()`). With `--compile`, oomtune compiles the layers
and leaves this loss eager, as that recipe's `torch.compile(model)` left its loss (it compiled the model alone).
Shape: examples/hf/llama-2-7b's config, no weights."""

import json
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = Path(__file__).parents[2] / "examples" / "hf" / "llama-2-7b" / "config.json"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _upcast(module, inputs, output):
    return output.float()  # (a forward hook's result replaces the module's output)


def build_model():
    model = LlamaForCausalLM(LlamaConfig(**json.loads(CONFIG.read_text())))
    model.lm_head.register_forward_hook(_upcast)
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS))


def make_batch(batch_size, context_length, device):
    ids = torch.randint(0, 32000, (batch_size, context_length), device=device)
    return {"input_ids": ids, "labels": ids}


def loss(model, batch):
    logits = model(input_ids=batch["input_ids"]).logits  # fp32, from the output layer
    shifted = logits[:, :-1].contiguous()
    return nn.functional.cross_entropy(shifted.transpose(1, 2), batch["labels"][:, 1:].contiguous())
