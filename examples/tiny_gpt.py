"""A small character-level GPT (nanoGPT's shape) as an oomtune model file.

Its transformer blocks live in one nn.ModuleList (`self.h`), so oomtune's default `blocks` finds them
for activation checkpointing; forward returns (logits, loss), which the default loss understands.
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256  # bytes
N_LAYER, N_HEAD, N_EMBD = 4, 4, 64
MAX_CONTEXT = 512

DEFAULTS = {"batch": 16, "context": 128}


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(N_EMBD, 3 * N_EMBD)
        self.proj = nn.Linear(N_EMBD, N_EMBD)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (z.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(N_EMBD), nn.LayerNorm(N_EMBD)
        self.attn = Attention()
        self.mlp = nn.Sequential(nn.Linear(N_EMBD, 4 * N_EMBD), nn.GELU(), nn.Linear(4 * N_EMBD, N_EMBD))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, N_EMBD)
        self.wpe = nn.Embedding(MAX_CONTEXT, N_EMBD)
        self.h = nn.ModuleList(Block() for _ in range(N_LAYER))
        self.ln_f = nn.LayerNorm(N_EMBD)
        self.head = nn.Linear(N_EMBD, VOCAB, bias=False)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
        for block in self.h:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, vocab)
        loss = F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))
        return logits, loss


def build_model():
    return TinyGPT()


def make_batch(batch_size, context_length, device):
    """Worst case: every sequence at full length."""
    x = torch.randint(0, VOCAB, (batch_size, context_length), device=device)
    y = torch.randint(0, VOCAB, (batch_size, context_length), device=device)
    return x, y
