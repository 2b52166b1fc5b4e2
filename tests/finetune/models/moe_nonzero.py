"""A top-1 mixture of experts: a router picks one expert per token and each expert runs on the tokens that
`nonzero` finds routed to it, so shapes depend on the router's weights (data-dependent)."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, EXPERTS = 64, 32, 4
DEFAULTS = {"batch": 4, "context": 16}


class TopOneMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(WIDTH, EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(EXPERTS))

    def forward(self, x):
        flat = x.reshape(-1, WIDTH)
        choice = self.router(flat).argmax(dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            tokens = (choice == e).nonzero().squeeze(-1)
            out = out.index_add(0, tokens, expert(flat[tokens]))
        return x + out.reshape_as(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.moe = TopOneMoE()
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.moe(self.embed(x))).flatten(0, 1), y.flatten())


def build_model():
    torch.manual_seed(0)  # the same router on every build: the same routing of the same batch
    return Net()


def make_batch(batch_size, context_length, device):
    g = torch.Generator().manual_seed(batch_size * 1000 + context_length)  # the same tokens for the same shape
    x = torch.randint(0, VOCAB, (batch_size, context_length), generator=g).to(device)
    return x, torch.roll(x, -1, dims=1)
