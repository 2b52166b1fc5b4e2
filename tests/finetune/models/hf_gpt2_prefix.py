"""A Hugging Face GPT-2 with PEFT prefix tuning: its trained prefix goes into every layer as a key/value cache,
which a Hugging Face model checkpointed in training runs without (the forward fails with a shape error: keys
shorter than the attention mask), so its ladder has no checkpointing rung."""

import peft
import torch
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 256
DEFAULTS = {"batch": 4, "context": 32}


def build_model():
    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64))
    return peft.get_peft_model(base, peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=8))


def make_batch(batch_size, context_length, device):
    ids = torch.randint(0, VOCAB, (batch_size, context_length), device=device)
    mask = torch.ones_like(ids)
    mask[:, -1] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}
