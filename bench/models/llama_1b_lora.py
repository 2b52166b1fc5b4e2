"""A 1B-class Llama (TinyLlama-1.1B's shape: 22 layers, hidden 2048, 32 query and 4 key/value heads, vocab 32000)
built from its config, no weights downloaded, with PEFT LoRA adapters (r=16 on every attention and MLP projection):
the fine-tuning a user runs on one card. The gpu-check's second realistic row (does the probe's prior pay in wall
time for a LoRA model on the GPU). Needs transformers and peft.

    oomtune estimate bench/models/llama_1b_lora.py --gpu rtx4090
"""

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 32000
DEFAULTS = {"batch": 16, "context": 1024, "min_context": 1024}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                         num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS)
    return get_peft_model(LlamaForCausalLM(config), lora)


def make_batch(batch_size, context_length, device):
    ids = torch.randint(0, VOCAB, (batch_size, context_length), device=device)
    return {"input_ids": ids, "labels": ids}
