"""A model file whose optimizer() is nanoGPT's configure_optimizers in shape: a plain torch AdamW over two param
groups, the matrices decaying and the biases and norms not, with betas and eps of its own. device: any."""

import torch
import torch.nn.functional as F
from torch import nn

WIDTH = 128  # a 128 x 128 matrix is whole 8-bit blocks (16384 elements)
DEFAULTS = {"batch": 8, "context": 8}
BETAS, EPS, DECAY = (0.9, 0.95), 1e-6, 0.05


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)) for _ in range(2))
        self.out = nn.Linear(WIDTH, 4)

    def forward(self, x, y):
        for layer in self.layers:
            x = x + torch.relu(layer(x))
        return F.cross_entropy(self.out(x).mean(1), y)


def build_model():
    return Net()


def make_batch(batch_size, context_length, device):
    x = torch.randn(batch_size, context_length, WIDTH, device=device)
    return x, x[..., :4].sum(1).argmax(-1)


def optimizer(params, lr, model):
    trained = {id(p) for p in params}
    named = [(n, p) for n, p in model.named_parameters() if id(p) in trained]
    decay = [p for n, p in named if p.dim() >= 2]
    no_decay = [p for n, p in named if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": DECAY}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=BETAS, eps=EPS)
