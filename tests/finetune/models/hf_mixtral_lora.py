"""A Hugging Face Mixtral (built from a config: 4 experts, top-2 routing) with PEFT LoRA on the attention
projections. transformers 5 runs its experts through grouped matmuls (aten._grouped_mm), whose meta kernel takes
bf16 alone where the CPU's kernel takes fp32 too."""

import torch
from peft import LoraConfig, get_peft_model
from transformers import MixtralConfig, MixtralForCausalLM

VOCAB = 128
DEFAULTS = {"batch": 4, "context": 32}


def build_model():
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=64)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return get_peft_model(MixtralForCausalLM(config), lora)


def make_batch(batch_size, context_length, device):
    ids = torch.randint(0, VOCAB, (batch_size, context_length), device=device)
    return {"input_ids": ids, "labels": ids}
