"""Several ranks: the process group and its agreement on out-of-memory errors, DDP / FSDP2, the torchrun launch."""
