"""A small image transformer whose layers are kept as vit-pytorch keeps them: one nn.ModuleList whose items are
nn.ModuleLists of [attention, feed-forward], never called themselves: the encoder unpacks each pair and calls its
two halves, each with a residual around it. device: any (tests run it on cpu and fake)."""

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, HEADS, DEPTH, PATCH, SIDE = 64, 4, 4, 4, 16
DEFAULTS = {"batch": 64, "context": 1}


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, HEADS, -1).transpose(1, 2) for t in self.qkv(self.norm(x)).chunk(3, dim=-1))
        weights = (q @ k.transpose(-1, -2) / (WIDTH // HEADS) ** 0.5).softmax(dim=-1)  # (b, heads, n, n)
        return self.out((weights @ v).transpose(1, 2).reshape(b, n, WIDTH))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                 nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        return self.net(x)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleList([SelfAttention(), MLP()]) for _ in range(DEPTH))
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x):
        for attend, mix in self.layers:  # the pairs are unpacked: a pair's own forward never runs
            x = x + attend(x)
            x = x + mix(x)
        return self.norm(x)


class ImageClassifier(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.embed = nn.Linear(3 * PATCH * PATCH, WIDTH)
        self.position = nn.Parameter(torch.zeros((SIDE // PATCH) ** 2, WIDTH))
        self.encoder = Encoder()
        self.head = nn.Linear(WIDTH, classes)

    def forward(self, images):
        b = images.shape[0]
        patches = images.unfold(2, PATCH, PATCH).unfold(3, PATCH, PATCH)  # (b, 3, rows, cols, PATCH, PATCH)
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(b, -1, 3 * PATCH * PATCH)
        x = self.encoder(self.embed(patches) + self.position)
        return self.head(x.mean(dim=1))


def build_model():
    return ImageClassifier()


def make_batch(batch_size, context_length, device):
    return (torch.randn(batch_size, 3, SIDE, SIDE, device=device),
            torch.randint(0, 10, (batch_size,), device=device))


def loss(model, batch):
    images, labels = batch
    return F.cross_entropy(model(images), labels)
