"""Llama 3.x's scaled rotary frequencies as torchtune builds them (Llama3ScaledRoPE.apply_scaling): a Python loop
over 0-d tensors, then torch.tensor(list). On fake tensors that build crashed ("data is not allocated yet").
A tiny causal LM: 2 blocks, context up to 64."""
import math

import torch
from torch import nn

VOCAB = 64
MAX_CONTEXT = 64
DEFAULTS = {"batch": 16, "context": 64}


def scaled_frequencies(dim, base=500000.0, scale=8.0, low=1.0, high=4.0, old_context=64):
    """As torchtune's Llama3ScaledRoPE.apply_scaling: a Python loop over 0-d tensors, then torch.tensor(list)."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    new = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old_context / high:
            new.append(f)
        elif wavelen > old_context / low:
            new.append(f / scale)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            new.append((1 - smooth) * f / scale + smooth * f)
    return torch.tensor(new, dtype=freqs.dtype, device=freqs.device)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x, cos, sin):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k = q * cos + q.roll(1, -1) * sin, k * cos + k.roll(1, -1) * sin
        return x + self.out(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))


class Model(nn.Module):
    def __init__(self, d=32, layers=2, max_context=64):
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, d), nn.Linear(d, VOCAB)
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))
        angles = torch.outer(torch.arange(max_context).float(), scaled_frequencies(d)).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x, y):
        h = self.embed(x)
        cos, sin = self.cos[: x.shape[1]], self.sin[: x.shape[1]]
        for layer in self.layers:
            h = layer(h, cos, sin)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def build_model():
    return Model()


def make_batch(batch_size, context_length, device):
    x = torch.randint(0, VOCAB, (batch_size, context_length), device=device)
    return x, x
