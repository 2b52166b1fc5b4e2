"""A Hugging Face Llama with PEFT LoHa adapters (a LyCORIS method): each layer applies its adapter only `if
torch.rand(1) > module_dropout` while training, a branch the fake device takes as real tensors do (it read the
valueless draw as False: no adapter, a loss without gradient, and estimate and check refused the plan)."""

import peft
import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 256
DEFAULTS = {"batch": 4, "context": 32}


def build_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return peft.get_peft_model(LlamaForCausalLM(config),
                               peft.LoHaConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))


def make_batch(batch_size, context_length, device):
    ids = torch.randint(0, VOCAB, (batch_size, context_length), device=device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
