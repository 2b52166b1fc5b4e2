"""The memory of common cards, for `--gpu NAME` (estimate, check). No torch here.

Memory is the total the driver reports (nvidia-smi's "MiB" column), the most a process could ever get.
The CUDA context, cuBLAS/cuDNN workspaces and the caching allocator's rounding come out of it: that is
the margin's job (margin.py), not the table's. Cards ship in variants (PCIe/SXM, ECC on/off) that differ by a
few hundred MiB; for an exact figure pass `--budget` with what `nvidia-smi --query-gpu=memory.total` says."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import OomtuneError

MiB = 1024**2


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int  # total as the driver reports it
    bf16: bool  # Ampere (sm80) and newer; without it `--amp auto` means fp16 + GradScaler
    aliases: tuple[str, ...] = ()


GPUS: tuple[GpuSpec, ...] = (
    GpuSpec("Tesla T4", 15360 * MiB, False, ("t4",)),
    GpuSpec("GeForce RTX 3060", 12288 * MiB, True, ("rtx3060", "3060")),
    GpuSpec("GeForce RTX 3090", 24576 * MiB, True, ("rtx3090", "3090")),
    GpuSpec("GeForce RTX 4090", 24564 * MiB, True, ("rtx4090", "4090")),
    GpuSpec("L4", 23034 * MiB, True, ("l4",)),
    GpuSpec("A10", 23028 * MiB, True, ("a10", "a10g")),
    GpuSpec("A100 40GB", 40960 * MiB, True, ("a100-40", "a100-40gb", "a100")),
    GpuSpec("A100 80GB", 81920 * MiB, True, ("a100-80", "a100-80gb")),
    GpuSpec("H100 80GB", 81559 * MiB, True, ("h100", "h100-80", "h100-80gb")),
    GpuSpec("H200", 143771 * MiB, True, ("h200", "h200-141gb")),
)


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower()).removeprefix("nvidia").removeprefix("geforce").removeprefix("tesla")


def find_gpu(name: str) -> GpuSpec:
    """`--gpu` lookup, forgiving about case, spaces and dashes: 'A100-80', 'rtx 4090', 'NVIDIA H100'."""
    k = _key(name)
    for spec in GPUS:
        if k in {_key(spec.name), *(_key(a) for a in spec.aliases)}:
            return spec
    known = ", ".join(spec.aliases[0] for spec in GPUS)
    raise OomtuneError(f"--gpu {name!r}: not in the table ({known}); pass --budget with the card's memory instead")

