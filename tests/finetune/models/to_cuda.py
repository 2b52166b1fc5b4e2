"""A build_model() written for the GPU and nothing else: `.to("cuda")`, `.cuda()` and a buffer made with
device="cuda", no torch.cuda.is_available() check. On the simulated devices cuda is the host (memory/on_host.py),
so it is estimated and probed where PyTorch has no CUDA at all."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH = 96, 24
DEFAULTS = {"batch": 4, "context": 16}


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)) for _ in range(2))
        self.register_buffer("gain", torch.full((WIDTH,), 0.5, device="cuda"))
        self.logits = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids, targets):
        h = self.tokens(ids)
        for layer in self.layers:
            h = h + self.gain * torch.tanh(layer(h))
        return F.cross_entropy(self.logits(h).transpose(1, 2), targets)


def build_model():
    model = LM().to("cuda")
    model.logits.cuda()
    return model


def make_batch(batch_size, context_length, device):
    ids = torch.randint(0, VOCAB, (batch_size, context_length), device=device)
    return ids, torch.roll(ids, 1, dims=1)
