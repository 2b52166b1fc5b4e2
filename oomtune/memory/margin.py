"""The margin: what a real GPU run needs beyond the tensors the tracker counts, added by a simulated device to its
tensor peak (and to its out-of-memory threshold). Two kinds, one interface: a flat rule (`--margin 512MiB+5%`), and
a card's own (CardMargin: its CUDA context, its cuBLAS workspaces and the caching allocator as modelled for each
trial). No torch here."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import OomtuneError, shown
from ..units import format_bytes, parse_budget
from .allocator import CachingAllocatorModel
from .cards import WORKSPACE_HANDLES, GpuSpec, find_gpu

DEFAULT_MARGIN = "512MiB+5%"


@dataclass(frozen=True)
class Margin:
    """Memory a real GPU run needs beyond the tensors the tracker counts:

    fixed_bytes  the CUDA context (driver state and loaded kernels, a few hundred MiB with lazy module
                 loading) and the cuBLAS / cuDNN workspaces;
    fraction     of the tensor peak, for the caching allocator: large blocks are rounded up to 2 MiB,
                 segments are reused imperfectly (fragmentation), so what it reserves exceeds what
                 tensors hold.

    The fake device reports `tensor peak + overhead(tensor peak)` as its peak and raises an OOM when
    that passes the budget. It is separate from --headroom, which is a policy (keep this much free for
    longer batches and luck), not a correction."""

    fixed_bytes: int = 0
    fraction: float = 0.0

    def __post_init__(self):
        if self.fixed_bytes < 0 or not 0 <= self.fraction < 1:
            raise OomtuneError(f"margin: fixed part must be >= 0 and the fraction in [0, 1), got {self.describe()}")

    def overhead(self, tensor_bytes: int, reserved_bytes: int | None = None) -> int:
        """Beyond `tensor_bytes` of tensors (a flat rule does not look at the allocator model's `reserved_bytes`)."""
        return self.fixed_bytes + math.ceil(tensor_bytes * self.fraction)

    def total(self, tensor_bytes: int, reserved_bytes: int | None = None) -> int:
        return tensor_bytes + self.overhead(tensor_bytes, reserved_bytes)

    def fixed_lines(self) -> dict[str, int]:
        """The fixed costs a breakdown shows as lines of their own (a flat rule has none)."""
        return {}

    def allocator_capacity(self, budget_bytes: int) -> int | None:
        """What the allocator model may reserve before it runs out (None: the tracker's budget decides)."""
        return None

    def seed(self, model: CachingAllocatorModel) -> None:
        """Put in the allocator model what lives there before any tensor (a flat rule: nothing)."""

    def text(self) -> str:
        return self.describe()

    def tensor_budget(self, budget_bytes: int) -> int:
        """The most tensor bytes whose total still fits in `budget_bytes` (the tracker's OOM threshold)."""
        return max(0, math.floor((budget_bytes - self.fixed_bytes) / (1 + self.fraction)))

    def describe(self) -> str:
        parts = []
        if self.fixed_bytes:
            parts.append(_size_text(self.fixed_bytes))
        if self.fraction:
            parts.append(f"{self.fraction * 100:g}%")
        return "+".join(parts) or "0"


@dataclass(frozen=True)
class CardMargin:
    """A card's own margin: its CUDA context (outside PyTorch's allocator), and what the caching allocator reserves
    beyond the tensors - its cuBLAS workspaces (blocks of their own) and its rounding and cached blocks, both from
    the allocator model that replays each trial (allocator.py, seeded with the workspaces). A simulated device's
    peak is then context + modelled reserved peak, what a real card's `max_memory_reserved` plus its context is."""

    card: GpuSpec

    def overhead(self, tensor_bytes: int, reserved_bytes: int | None = None) -> int:
        """Without the allocator model's reserved peak (a floor, before any trial): the fixed costs alone."""
        if reserved_bytes is None:
            return self.card.context + self.seeded_bytes
        return self.card.context + max(reserved_bytes - tensor_bytes, self.seeded_bytes)

    def total(self, tensor_bytes: int, reserved_bytes: int | None = None) -> int:
        return tensor_bytes + self.overhead(tensor_bytes, reserved_bytes)

    def tensor_budget(self, budget_bytes: int) -> int:
        """Tensor bytes at the most: the budget less the context and the segments the workspaces reserve."""
        return max(0, budget_bytes - self.card.context - self.seeded_bytes)

    def allocator_capacity(self, budget_bytes: int) -> int:
        return budget_bytes - self.card.context

    def seed(self, model: CachingAllocatorModel) -> None:
        """The cuBLAS workspaces, one block per handle, before any tensor (they outlive trials on a real card)."""
        for i in range(WORKSPACE_HANDLES):
            model.malloc(("cublas workspace", i), self.card.workspace_bytes // WORKSPACE_HANDLES)

    @property
    def seeded_bytes(self) -> int:
        """What the allocator reserves for the workspaces alone (an 8.125 MiB one takes a 20 MiB segment)."""
        model = CachingAllocatorModel()
        self.seed(model)
        return model.reserved_bytes

    def fixed_lines(self) -> dict[str, int]:
        return {"context": self.card.context, "workspaces": self.card.workspace_bytes}

    def describe(self) -> str:
        """The rule as configs record it, which parse_margin reads back: 'card:h100'."""
        return f"card:{self.card.aliases[0]}"

    def text(self) -> str:
        assumed = " (assumed: not yet measured on this card)" if self.card.context_bytes is None else ""
        return (f"CUDA context {format_bytes(self.card.context)}{assumed} + cuBLAS workspaces "
                f"{format_bytes(self.card.workspace_bytes)} + the caching allocator, modelled")


AnyMargin = Margin | CardMargin


def _size_text(n: int) -> str:
    """Exact and short, so describe() parses back: 536870912 -> '512MiB', 1000 -> '1000B'."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


def parse_margin(text: str | None) -> AnyMargin:
    """'512MiB+5%', '1GiB', '8%', '0', 'card:h100' (that card's own); None means the default flat rule."""
    s = (DEFAULT_MARGIN if text is None else str(text)).replace(" ", "")
    if s.startswith("card:"):
        return CardMargin(find_gpu(s.removeprefix("card:")))
    if s in ("0", "none"):
        return Margin()
    fixed, fraction = 0, 0.0
    for part in s.split("+"):
        if part.endswith("%"):
            try:
                fraction += float(part[:-1]) / 100
                if not 0 <= fraction < 1:  # (nan, inf, or all of the budget)
                    raise ValueError(part)
            except ValueError:
                raise OomtuneError(f"--margin {shown(text)}: expected e.g. 512MiB+5%, 1GiB, 8% or 0") from None
        else:
            try:
                fixed += parse_budget(part)
            except OomtuneError:
                raise OomtuneError(f"--margin {shown(text)}: expected e.g. 512MiB+5%, 1GiB, 8% or 0") from None
    return Margin(fixed, fraction)

