"""A GPT with parallel attention + MLP blocks (GPT-J / PaLM style) kept in a custom container.

Differs from examples/tiny_gpt.py where it matters to oomtune:
- each block computes attention and a SwiGLU MLP from the same normalised input and adds both to the
  residual in one go (x + attn(ln(x)) + mlp(ln(x))), so a block saves a different set of activations;
- the blocks live in `Trunk`, a plain nn.Module that registers them as named children: there is no
  nn.ModuleList, so oomtune's default `blocks` finds nothing and this file's `blocks` hook says where
  checkpointing wraps;
- forward returns logits only; the `loss` hook computes the loss; input and output embeddings are tied.
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 512
N_LAYER, N_HEAD, N_EMBD = 4, 4, 96
MAX_CONTEXT = 256

DEFAULTS = {"batch": 16, "context": 64}


class ParallelBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(N_EMBD)  # one norm feeds both branches
        self.qkv = nn.Linear(N_EMBD, 3 * N_EMBD, bias=False)
        self.attn_out = nn.Linear(N_EMBD, N_EMBD, bias=False)
        self.gate_up = nn.Linear(N_EMBD, 2 * 2 * N_EMBD, bias=False)  # SwiGLU: gate and up, hidden 2C
        self.down = nn.Linear(2 * N_EMBD, N_EMBD, bias=False)

    def forward(self, x):  # (B, T, C)
        B, T, C = x.shape
        h = self.ln(x)
        q, k, v = self.qkv(h).split(C, dim=2)
        q, k, v = (z.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        gate, up = self.gate_up(h).chunk(2, dim=2)  # (B, T, 2C) each
        return x + self.attn_out(a) + self.down(F.silu(gate) * up)


class Trunk(nn.Module):
    """Blocks as named children `layer0..layerN`, run in order: a container the default finder does not know."""

    def __init__(self, n):
        super().__init__()
        self.n = n
        for i in range(n):
            self.add_module(f"layer{i}", ParallelBlock())

    def layers(self):
        return [getattr(self, f"layer{i}") for i in range(self.n)]

    def forward(self, x):
        for layer in self.layers():
            x = layer(x)
        return x


class ParallelGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, N_EMBD)
        self.wpe = nn.Embedding(MAX_CONTEXT, N_EMBD)
        self.trunk = Trunk(N_LAYER)
        self.ln_f = nn.LayerNorm(N_EMBD)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
        return self.ln_f(self.trunk(x)) @ self.wte.weight.t()  # (B, T, vocab), tied to the input embedding


def build_model():
    return ParallelGPT()


def make_batch(batch_size, context_length, device):
    """Worst case: every sequence at full length; targets are the inputs shifted by one."""
    tokens = torch.randint(0, VOCAB, (batch_size, context_length + 1), device=device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss(model, batch):
    idx, targets = batch
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def blocks(model):
    return model.trunk.layers()
