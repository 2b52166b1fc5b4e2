"""BERT-large (24 layers, hidden 1024, 16 heads, 340M parameters) built from its config by transformers, as a
sequence classifier fine-tuned at sequence length 512. No weights are downloaded: the fake device builds it as
shapes. BERT_ATTENTION picks transformers' attention implementation (default sdpa, as transformers does; eager
computes softmax(QK^T) with explicit ops)."""

import os

import torch
from transformers import BertConfig, BertForSequenceClassification

VOCAB, LABELS = 30522, 2
DEFAULTS = {"batch": 8, "context": 512}


def build_model():
    config = BertConfig(vocab_size=VOCAB, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                        intermediate_size=4096, max_position_embeddings=512, num_labels=LABELS,
                        attn_implementation=os.environ.get("BERT_ATTENTION", "sdpa"))
    return BertForSequenceClassification(config)


def make_batch(batch_size, context_length, device):
    return {"input_ids": torch.randint(0, VOCAB, (batch_size, context_length), device=device),
            "labels": torch.randint(0, LABELS, (batch_size,), device=device)}
