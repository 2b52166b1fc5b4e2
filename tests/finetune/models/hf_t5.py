"""A Hugging Face T5 (from a config): an encoder and a decoder, two stacks of blocks, fed a masked batch."""

import torch
from transformers import T5Config, T5ForConditionalGeneration

VOCAB = 256
DEFAULTS = {"batch": 4, "context": 32}


def build_model():
    config = T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                      num_heads=4, decoder_start_token_id=0, pad_token_id=0)
    return T5ForConditionalGeneration(config)


def make_batch(batch_size, context_length, device):
    ids = torch.randint(1, VOCAB, (batch_size, context_length), device=device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.flip(ids, dims=[1])}
