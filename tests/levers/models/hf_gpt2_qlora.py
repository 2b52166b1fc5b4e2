"""A Hugging Face GPT-2 built from a config (nothing downloaded) with PEFT LoRA adapters on its projections, which
are transformers' Conv1D (weight stored (in, out)), not nn.Linear: 8 frozen projections in whole NF4 blocks. The
QLoRA lever on a GPT-2-style model. No dropout, so two forwards of the same batch can be compared."""

import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 256
DEFAULTS = {"batch": 4, "context": 64}


def build_model():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_embd=128, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn", "c_proj", "c_fc"],
                      fan_in_fan_out=True)
    return get_peft_model(GPT2LMHeadModel(config), lora)


def make_batch(batch_size, context_length, device):
    ids = torch.randint(0, VOCAB, (batch_size, context_length), device=device)
    return {"input_ids": ids, "labels": ids}
