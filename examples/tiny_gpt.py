"""A small character-level GPT (nanoGPT's shape) as an oomtune model file.

Its transformer blocks live in one nn.ModuleList (`self.h`), so oomtune's default `blocks` finds them
for activation checkpointing; forward returns (logits, loss), which the default loss understands.

Real data without a download: the Python standard library's own top-level .py sources on this machine,
read as bytes (vocab 256). Every 10th file (sorted by name) is held out for evaluation.
"""

import functools
import sysconfig
from pathlib import Path

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


EVAL_EVERY_NTH_FILE = 10


@functools.lru_cache(maxsize=1)
def _corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, eval) byte tensors from the standard library's sources: deterministic on one machine."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    if len(files) < EVAL_EVERY_NTH_FILE:
        raise RuntimeError(f"found only {len(files)} Python sources in {stdlib} to train on")
    parts: tuple[list[bytes], list[bytes]] = ([], [])
    for i, f in enumerate(files):
        parts[i % EVAL_EVERY_NTH_FILE == EVAL_EVERY_NTH_FILE - 1].append(f.read_bytes())
    return tuple(torch.frombuffer(bytearray(b"\n".join(p)), dtype=torch.uint8).long() for p in parts)


def _windows(data: torch.Tensor, starts: torch.Tensor, context_length: int, device):
    idx = starts[:, None] + torch.arange(context_length + 1)  # (B, T+1)
    chunk = data[idx]
    return chunk[:, :-1].to(device), chunk[:, 1:].to(device)  # inputs, next-byte targets


def train_batches(batch_size, context_length, device):
    """Random windows of the training text, forever (oomtune seeds the generator)."""
    data = _corpus()[0]
    while True:
        starts = torch.randint(0, len(data) - context_length - 1, (batch_size,))
        yield _windows(data, starts, context_length, device)


def eval_batches(batch_size, context_length, device):
    """Evenly spaced windows across the held-out text: the same batches every evaluation."""
    data = _corpus()[1]
    span = len(data) - context_length - 1
    step = max(1, span // 4096)  # 4096 windows spread over the whole eval text
    for first in range(0, 4096, batch_size):
        starts = (torch.arange(first, first + batch_size) * step) % span
        yield _windows(data, starts, context_length, device)
