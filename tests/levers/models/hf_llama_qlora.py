"""A Hugging Face Llama built from a config (nothing downloaded) with PEFT LoRA adapters on every projection, its
frozen projections whole NF4 blocks (128 x 128, 256 x 128): the QLoRA lever's model. The output head stays as it
is (QLoRA keeps it)."""

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 256
DEFAULTS = {"batch": 4, "context": 64}


def build_model():
    torch.manual_seed(0)  # the frozen base is the same on every build (a resumed run rebuilds it)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return get_peft_model(LlamaForCausalLM(config), lora)


def make_batch(batch_size, context_length, device):
    ids = torch.randint(0, VOCAB, (batch_size, context_length), device=device)
    return {"input_ids": ids, "labels": ids}
