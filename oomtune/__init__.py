"""oomtune: find the largest PyTorch training configuration that fits in memory, then train with it."""

__version__ = "0.1.0"
