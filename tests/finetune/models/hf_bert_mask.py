"""A Hugging Face BERT classifier (from a config) fed input_ids and an attention_mask, as a fine-tuning batch is.
PAD_FROM: where each row's padding starts (None: no padding, the all-ones mask transformers drops)."""

import os

import torch
from transformers import BertConfig, BertForSequenceClassification

VOCAB, LABELS = 512, 3
DEFAULTS = {"batch": 4, "context": 128}
PAD_FROM = int(os.environ["PAD_FROM"]) if os.environ.get("PAD_FROM") else None


def build_model():
    config = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=256, num_labels=LABELS)
    return BertForSequenceClassification(config)


def make_batch(batch_size, context_length, device):
    ids = torch.randint(1, VOCAB, (batch_size, context_length), device=device)
    mask = torch.ones_like(ids)
    if PAD_FROM is not None:
        mask[:, PAD_FROM:] = 0
    return {"input_ids": ids, "attention_mask": mask,
            "labels": torch.randint(0, LABELS, (batch_size,), device=device)}
