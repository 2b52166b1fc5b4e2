"""Card profiles, for `--gpu NAME`: a card's memory, its compute capability and its fixed costs. No torch here.

Memory is the total the driver reports (nvidia-smi's "MiB" column), the most a process could ever get. What a
training process needs beyond its tensors comes out of it (margin.CardMargin):

- the CUDA context (driver state and loaded kernels), outside PyTorch's allocator. No documented rule gives its
  size: a card's figure is what `make gpu-check` measured on it (`context_bytes`); a card not measured yet is
  assumed to need ASSUMED_CONTEXT, and the estimate says so.
- cuBLAS workspaces, allocated through PyTorch's caching allocator: one per (cuBLAS handle, stream), of PyTorch's
  default size for the card's compute capability (cublas_workspace_bytes), and one handle per thread that runs
  matrix products: the one running the forward and the autograd engine's thread running the backward
  (WORKSPACE_HANDLES). cuBLASLt shares the cuBLAS workspace (PyTorch's default, TORCH_CUBLASLT_UNIFIED_WORKSPACE).
- the caching allocator's rounding and cached blocks: modelled per trial (allocator.py).

Cards ship in variants (PCIe/SXM, ECC on/off) that differ by a few hundred MiB; for an exact figure pass `--budget`
with what `nvidia-smi --query-gpu=memory.total` says."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import OomtuneError

KiB, MiB = 1024, 1024**2
ASSUMED_CONTEXT = 512 * MiB  # a card's CUDA context until gpu-check measured it (the old flat margin's fixed part)
WORKSPACE_HANDLES = 2  # cuBLAS handles are per thread: the forward's and the autograd engine's device thread


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int | None  # total as the driver reports it (None: the generic profile, which has a --budget)
    compute_capability: tuple[int, int]
    aliases: tuple[str, ...] = ()
    context_bytes: int | None = None  # the CUDA context make gpu-check measured on this card (None: not yet)

    @property
    def bf16(self) -> bool:
        """Native bf16: Ampere (sm80) and newer; without it `--amp auto` means fp16 + GradScaler."""
        return self.compute_capability >= (8, 0)

    @property
    def sm(self) -> str:
        return "sm{}{}".format(*self.compute_capability)

    @property
    def context(self) -> int:
        return ASSUMED_CONTEXT if self.context_bytes is None else self.context_bytes

    @property
    def workspace_bytes(self) -> int:
        """All the cuBLAS workspaces a training step makes on this card."""
        return WORKSPACE_HANDLES * cublas_workspace_bytes(self.compute_capability)


def cublas_workspace_bytes(compute_capability: tuple[int, int]) -> int:
    """PyTorch's default cuBLAS workspace for one handle and stream (at/cuda/CublasHandlePool.cpp, no
    CUBLAS_WORKSPACE_CONFIG): 32 MiB on Hopper and Blackwell (sm9x, sm10x, sm12x), else ":4096:2:16:8", two
    4096 KiB chunks and eight 16 KiB ones."""
    if compute_capability[0] in (9, 10, 12):
        return 4096 * 8 * KiB
    return 4096 * KiB * 2 + 16 * KiB * 8


GPUS: tuple[GpuSpec, ...] = (
    GpuSpec("Tesla V100 16GB", 16160 * MiB, (7, 0), ("v100-16", "v100-16gb")),
    GpuSpec("Tesla V100 32GB", 32510 * MiB, (7, 0), ("v100-32", "v100-32gb")),
    GpuSpec("Tesla T4", 15360 * MiB, (7, 5), ("t4",)),
    GpuSpec("GeForce RTX 3060", 12288 * MiB, (8, 6), ("rtx3060", "3060")),
    GpuSpec("GeForce RTX 3090", 24576 * MiB, (8, 6), ("rtx3090", "3090")),
    GpuSpec("GeForce RTX 4090", 24564 * MiB, (8, 9), ("rtx4090", "4090")),
    GpuSpec("L4", 23034 * MiB, (8, 9), ("l4",)),
    GpuSpec("A10", 23028 * MiB, (8, 6), ("a10", "a10g")),
    GpuSpec("RTX A6000", 49140 * MiB, (8, 6), ("a6000", "rtxa6000")),
    GpuSpec("L40S", 46068 * MiB, (8, 9), ("l40s",)),
    GpuSpec("A100 40GB", 40960 * MiB, (8, 0), ("a100-40", "a100-40gb")),
    GpuSpec("A100 80GB", 81920 * MiB, (8, 0), ("a100-80", "a100-80gb")),
    GpuSpec("H100 80GB", 81559 * MiB, (9, 0), ("h100", "h100-80", "h100-80gb")),
    # context: make gpu-check on an H200, 2026-12-04 (torch 2.11.0+cu130, driver 580.159.04): NVML used after a
    # training step's warm-up, less used before and less PyTorch's reserved memory
    GpuSpec("H200", 143771 * MiB, (9, 0), ("h200", "h200-141gb"), context_bytes=802750464),
)

# `estimate --budget` without --gpu: a card of that memory with Ampere's rules (bf16, flash attention, PyTorch's
# sm80 cuBLAS workspace). It is named wherever an estimate made with it is shown.
GENERIC = GpuSpec("a generic sm80 card", None, (8, 0), ("generic",))


# a model sold with more than one memory size: which one the user has changes every estimate
AMBIGUOUS = {"a100": "a100-40 (40 GB) or a100-80 (80 GB)", "v100": "v100-16 (16 GB) or v100-32 (32 GB)"}


def card_for(name: str, memory_bytes: int, compute_capability: tuple[int, int]) -> GpuSpec:
    """The profile of a card the driver names: the table's where it knows the name (and the compute capability
    matches) or, for a variant's longer name ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"), the one card of
    that model, compute capability and memory (within MEMORY_MATCH); else one made from what the driver reports."""
    try:
        spec = find_gpu(name)
    except OomtuneError:
        spec = None
    if spec is not None and spec.compute_capability == compute_capability:
        return spec
    words = re.findall(r"[a-z0-9]+", name.lower())
    words += [a + b for a, b in zip(words, words[1:], strict=False)]  # "rtx", "4090" -> "rtx4090"
    same = [g for g in GPUS if g.compute_capability == compute_capability and g.memory_bytes
            and abs(g.memory_bytes - memory_bytes) <= MEMORY_MATCH * g.memory_bytes and _model(g) in words]
    if len(same) == 1:
        return same[0]
    return GpuSpec(name, memory_bytes, compute_capability, (_key(name),))


MEMORY_MATCH = 0.03  # variants of one card differ by a few hundred MiB (ECC, PCIe/SXM); the next size by far more


def _model(spec: GpuSpec) -> str:
    """The model a card's first alias names: 'a100' of 'a100-80', 'rtx4090', 't4'."""
    found = re.match(r"[a-z]+[0-9]+", spec.aliases[0])
    return found.group(0) if found else spec.aliases[0]


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower()).removeprefix("nvidia").removeprefix("geforce").removeprefix("tesla")


# words of a driver's name for a variant of the same card: form factor and memory kind, not its size
# (an H100 NVL is another card: 94 GB)
VARIANT_WORDS = {"sxm", "sxm2", "sxm3", "sxm4", "sxm5", "pcie", "hbm2", "hbm2e", "hbm3", "hbm3e"}


def find_gpu(name: str) -> GpuSpec:
    """`--gpu` lookup, forgiving about case, spaces and dashes: 'A100-80', 'rtx 4090', 'NVIDIA H100', 'generic';
    and the driver's own names, as nvidia-smi prints them: 'NVIDIA A100-SXM4-80GB', 'Tesla V100-PCIE-16GB'."""
    k = _key(name)
    if k in AMBIGUOUS:
        raise OomtuneError(f"--gpu {name!r} names more than one card: {AMBIGUOUS[k]}")
    variant = _key("".join(w for w in re.findall(r"[a-z0-9]+", name.lower()) if w not in VARIANT_WORDS))
    for key in dict.fromkeys((k, variant)):
        for spec in (*GPUS, GENERIC):
            if key in {_key(spec.name), *(_key(a) for a in spec.aliases)}:
                return spec
    known = ", ".join(spec.aliases[0] for spec in (*GPUS, GENERIC))
    raise OomtuneError(f"--gpu {name!r}: not in the table ({known}); pass --budget with the card's memory instead")
