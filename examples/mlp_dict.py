"""A token-classifier MLP that takes dict batches and returns (logits, loss): no optional hooks.

Each example is a sequence of `context_length` token ids mapped to one label; the per-position MLP
runs on every token (so memory grows with context), then the sequence is mean-pooled.
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, CLASSES, WIDTH = 512, 10, 128

DEFAULTS = {"batch": 32, "context": 64}


class TokenMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
            for _ in range(3)
        )
        self.out = nn.Linear(WIDTH, CLASSES)

    def forward(self, tokens, labels):
        h = self.embed(tokens)  # (B, T, W)
        for layer in self.layers:
            h = h + layer(h)
        logits = self.out(h.mean(dim=1))  # (B, classes)
        return logits, F.cross_entropy(logits, labels)


def build_model():
    return TokenMLP()


def make_batch(batch_size, context_length, device):
    return {
        "tokens": torch.randint(0, VOCAB, (batch_size, context_length), device=device),
        "labels": torch.randint(0, CLASSES, (batch_size,), device=device),
    }
