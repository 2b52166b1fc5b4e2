"""A 7B Llama (Llama-2-7B's shape: 32 layers, hidden 4096, vocab 32000) built from its config, no weights
downloaded, every parameter trained: full fine-tuning. For `oomtune estimate` on the fake device (on a real
device it would build 6.7B random parameters). Needs transformers (pip install 'oomtune[finetune]').

    oomtune estimate examples/finetune/llama_7b.py --gpu rtx4090
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 32000
DEFAULTS = {"batch": 8, "context": 2048, "min_context": 2048}


def llama_7b_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)


def build_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_7b_config())


def make_batch(batch_size, context_length, device):
    ids = torch.randint(0, VOCAB, (batch_size, context_length), device=device)
    return {"input_ids": ids, "labels": ids}
