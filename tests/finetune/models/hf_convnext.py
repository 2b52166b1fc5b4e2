"""A Hugging Face ConvNext image classifier (built from a config): transformers gives it no activation checkpointing
(supports_gradient_checkpointing is False, its switch raises), so the checkpointing rung wraps its stages, the
longest ModuleList, as any model's. Images: context 1."""

import torch
import torch.nn.functional as F
from transformers import ConvNextConfig, ConvNextForImageClassification

LABELS = 10
DEFAULTS = {"batch": 16, "context": 1}


def build_model():
    torch.manual_seed(0)
    config = ConvNextConfig(num_channels=3, patch_size=4, num_stages=2, hidden_sizes=[32, 64], depths=[2, 2],
                            num_labels=LABELS, image_size=32)
    return ConvNextForImageClassification(config)


def make_batch(batch_size, context_length, device):
    return (torch.randn(batch_size, 3, 32, 32, device=device),
            torch.randint(0, LABELS, (batch_size,), device=device))


def loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(pixel_values=x).logits, y, label_smoothing=0.1)
