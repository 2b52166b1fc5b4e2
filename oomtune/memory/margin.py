"""The margin: what a real GPU run needs beyond the tensors the tracker counts, added by the fake device to its
tensor peak (and to its out-of-memory threshold). No torch here."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import OomtuneError
from ..units import parse_budget

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

    def overhead(self, tensor_bytes: int) -> int:
        return self.fixed_bytes + math.ceil(tensor_bytes * self.fraction)

    def total(self, tensor_bytes: int) -> int:
        return tensor_bytes + self.overhead(tensor_bytes)

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


def _size_text(n: int) -> str:
    """Exact and short, so describe() parses back: 536870912 -> '512MiB', 1000 -> '1000B'."""
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


def parse_margin(text: str | None) -> Margin:
    """'512MiB+5%', '1GiB', '8%', '0'; None means the default."""
    s = (DEFAULT_MARGIN if text is None else str(text)).replace(" ", "")
    if s in ("0", "none"):
        return Margin()
    fixed, fraction = 0, 0.0
    for part in s.split("+"):
        if part.endswith("%"):
            try:
                fraction += float(part[:-1]) / 100
            except ValueError:
                raise OomtuneError(f"--margin {text!r}: expected e.g. 512MiB+5%, 1GiB, 8% or 0") from None
        else:
            try:
                fixed += parse_budget(part)
            except OomtuneError:
                raise OomtuneError(f"--margin {text!r}: expected e.g. 512MiB+5%, 1GiB, 8% or 0") from None
    return Margin(fixed, fraction)

