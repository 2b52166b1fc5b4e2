"""A build_model() written for the GPU and nothing else: `.to("cuda")`, `.cuda()` and a buffer made with
device="cuda", no torch.cuda.is_available() check. On the simulated devices cuda is the host (memory/on_host.py),
so it is estimated and probed where PyTorch has no CUDA at all."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH = 128, 32
DEFAULTS = {"batch": 4, "context": 16}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("scale", torch.ones(WIDTH, device="cuda"))

    def forward(self, x):
        return x + F.gelu(self.fc(x)) * self.scale


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, x, y):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def build_model():
    model = Net().to("cuda")
    model.head.cuda()
    return model


def make_batch(batch_size, context_length, device):
    x = torch.randint(0, VOCAB, (batch_size, context_length), device=device)
    return x, torch.roll(x, -1, dims=1)
