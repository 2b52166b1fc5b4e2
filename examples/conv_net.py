"""A 1-D residual conv net over a sequence whose forward returns an object with `.loss`, the way
Hugging Face models do. No optional hooks: checkpointing finds `self.stages` by default."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

CHANNELS, VOCAB = 64, 128

DEFAULTS = {"batch": 16, "context": 256}


@dataclass
class Output:
    logits: torch.Tensor
    loss: torch.Tensor


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(CHANNELS, CHANNELS, kernel_size=5, padding=2)
        self.conv2 = nn.Conv1d(CHANNELS, CHANNELS, kernel_size=5, padding=2)
        self.norm = nn.GroupNorm(8, CHANNELS)

    def forward(self, x):  # (B, C, T)
        return x + self.conv2(F.gelu(self.conv1(self.norm(x))))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, CHANNELS)
        self.stages = nn.ModuleList(Residual() for _ in range(4))
        self.head = nn.Conv1d(CHANNELS, VOCAB, kernel_size=1)

    def forward(self, x):
        tokens = x
        h = self.embed(tokens).transpose(1, 2)  # (B, C, T)
        for stage in self.stages:
            h = stage(h)
        logits = self.head(h)  # (B, vocab, T): predict each token from the sequence around it
        return Output(logits, F.cross_entropy(logits, tokens))


def build_model():
    return ConvNet()


def make_batch(batch_size, context_length, device):
    return torch.randint(0, VOCAB, (batch_size, context_length), device=device)
