"""A small causal language model built as a Hugging Face config.json saying `torch_dtype: bfloat16` builds it:
AutoModelForCausalLM.from_config gives every weight in bf16 (the rotary frequencies, a buffer, stay fp32).
device: any (tests run it on cpu and fake)."""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

VOCAB = 256
DEFAULTS = {"batch": 8, "context": 32}


def build_model():
    config = LlamaConfig.from_dict({  # as a config.json reads
        "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 176,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    })
    return AutoModelForCausalLM.from_config(config)


def make_batch(batch_size, context_length, device):
    ids = torch.randint(0, VOCAB, (batch_size, context_length), device=device)
    return {"input_ids": ids, "labels": ids}
