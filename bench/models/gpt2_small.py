"""GPT-2 small (124M parameters, context 1024) as an oomtune model file, nanoGPT's shape: 12 layers,
12 heads, 768 wide, the 50257-token vocabulary, learned positions, and the output head tied to the token
embedding, so its 38.6M weights are counted once (TIE_WEIGHTS = False unties them). No dropout (fine-tuning
often runs with it off; with it on, each dropout would also keep a mask for the backward).

Used by bench/bench_estimate.py: `oomtune estimate` runs the whole ladder for it on fake tensors.
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, N_LAYER, N_HEAD, N_EMBD, MAX_CONTEXT = 50257, 12, 12, 768, 1024
TIE_WEIGHTS = True  # GPT-2 ties the output head to the token embedding; bench_estimate also measures it untied

DEFAULTS = {"batch": 8, "context": 1024}


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(N_EMBD, 3 * N_EMBD)
        self.c_proj = nn.Linear(N_EMBD, N_EMBD)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (z.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(N_EMBD, 4 * N_EMBD)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * N_EMBD, N_EMBD)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(N_EMBD), nn.LayerNorm(N_EMBD)
        self.attn, self.mlp = Attention(), MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, N_EMBD)
        self.wpe = nn.Embedding(MAX_CONTEXT, N_EMBD)
        self.h = nn.ModuleList(Block() for _ in range(N_LAYER))
        self.ln_f = nn.LayerNorm(N_EMBD)
        self.lm_head = nn.Linear(N_EMBD, VOCAB, bias=False)
        if TIE_WEIGHTS:
            self.lm_head.weight = self.wte.weight  # weight tying, as GPT-2 does

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        loss = F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))
        return logits, loss


def build_model():
    return GPT()


def make_batch(batch_size, context_length, device):
    """Worst case: every sequence at full length."""
    x = torch.randint(0, VOCAB, (batch_size, context_length), device=device)
    y = torch.randint(0, VOCAB, (batch_size, context_length), device=device)
    return x, y
