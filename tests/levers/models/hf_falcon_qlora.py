"""A PEFT LoRA Falcon (built from a config, nothing downloaded): every projection is transformers' FalconLinear, an
nn.Linear subclass whose forward computes x @ W.T itself, so the NF4 lever has no layer to store (its forward would
transpose an NF4 weight, which torchao does not support)."""

import torch
from peft import LoraConfig, get_peft_model
from transformers import FalconConfig, FalconForCausalLM

VOCAB = 300
DEFAULTS = {"batch": 4, "context": 32}


def build_model():
    torch.manual_seed(0)
    config = FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          multi_query=True, new_decoder_architecture=False, parallel_attn=True, bias=False)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["query_key_value", "dense"])
    return get_peft_model(FalconForCausalLM(config), lora)


def make_batch(batch_size, context_length, device):
    ids = torch.randint(0, VOCAB, (batch_size, context_length), device=device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
