"""A tiny causal LM of 6 blocks of the same classes and shapes of which only the later ones do something once: from
the third on, each is a local-attention layer (its window 64, the first two's None) that builds its band mask from a
wide scratch tensor on its first forward and keeps it for the steps after. A check of the second step made on the
first 2 blocks never sees it; the window setting tells the blocks apart (checkpointing.repeated_runs). device: any
(tests run it on fake)."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, HEADS, LAYERS = 256, 64, 4, 6
DEFAULTS = {"batch": 16, "context": 128}


class Block(nn.Module):
    def __init__(self, window: int | None):
        super().__init__()
        self.window = window  # None: full attention
        self.band = None  # the local layer's mask, made on its first forward
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        B, T, C = x.shape
        if self.window is not None:
            if self.band is None or self.band.shape[0] != T:
                self.band = torch.ones(T, T, 256, device=x.device).amax(-1).triu(-self.window).tril()
            x = x * self.band[:, :1].sum() / T
        q, k, v = (z.view(B, T, HEADS, C // HEADS).transpose(1, 2) for z in self.qkv(self.norm1(x)).split(C, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.out(y)
        return x + self.mlp(self.norm2(x))


class LocalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.h = nn.ModuleList(Block(None if i < 2 else 64) for i in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx, targets):
        x = self.embed(idx)
        for block in self.h:
            x = block(x)
        logits = self.head(self.norm(x))
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def build_model():
    return LocalLM()


def make_batch(batch_size, context_length, device):
    idx = torch.randint(0, VOCAB, (batch_size, context_length + 1), device=device)
    return idx[:, :-1], idx[:, 1:]
