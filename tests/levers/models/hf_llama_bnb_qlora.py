"""A Hugging Face Llama built from a config (nothing downloaded) with PEFT LoRA adapters on q and v, and the
4-bit weights a QLoRA guide loads it with: transformers' BitsAndBytesConfig (NF4, double quantization), which
oomtune reads from the file and applies on every rung, in bitsandbytes' own layout. The output head stays as it is."""

import torch
from peft import LoraConfig, get_peft_model
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

VOCAB = 256
DEFAULTS = {"batch": 4, "context": 64}

quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=torch.bfloat16)


def build_model():
    torch.manual_seed(0)  # the frozen base is the same on every build (a resumed run rebuilds it)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    return get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def make_batch(batch_size, context_length, device):
    ids = torch.randint(0, VOCAB, (batch_size, context_length), device=device)
    return {"input_ids": ids, "labels": ids}
