"""A build_model() that moves and casts its model (.to(device), .to(dtype), .half() and back), ties the output head to
the embedding and freezes a block: what many model files do before returning."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH = 128, 32
DEFAULTS = {"batch": 4, "context": 16}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + F.gelu(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, x, y):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def build_model():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = Net().to(device).to(torch.float32)
    model.blocks[0].requires_grad_(False)  # frozen: no gradient, no optimizer state
    return model.half().float()


def make_batch(batch_size, context_length, device):
    x = torch.randint(0, VOCAB, (batch_size, context_length), device=device)
    return x, torch.roll(x, -1, dims=1)
