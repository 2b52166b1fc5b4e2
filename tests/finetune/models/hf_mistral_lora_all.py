"""A Hugging Face Mistral (built from a config) with PEFT LoRA on every projection, a sliding window shorter than
the context. With transformers' own checkpointing on, a trial that runs out of memory in backward's recompute left
its layers alive until the next backward (memory/leftovers.py)."""

import torch
from peft import LoraConfig, get_peft_model
from transformers import MistralConfig, MistralForCausalLM

VOCAB = 512
DEFAULTS = {"batch": 4, "context": 64}
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_model():
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           sliding_window=16)
    lora = LoraConfig(r=32, lora_alpha=64, target_modules=PROJECTIONS, task_type="CAUSAL_LM")
    return get_peft_model(MistralForCausalLM(config), lora)


def make_batch(batch_size, context_length, device):
    ids = torch.randint(0, VOCAB, (batch_size, context_length), device=device)
    return {"input_ids": ids, "labels": ids}
