"""When nothing fits only because of the headroom: a plan that ran under the budget but over the limit the headroom
leaves ((1 - headroom) x budget: a trial's `over-headroom`), and the --headroom that would admit it, with its risk.

(Qwen-7B QLoRA peaked at 11.22 GiB on a 12 GiB card: under the budget, over the 10.80 GiB that 10% headroom leaves;
the search said nothing fits and named a larger budget or a smaller model, not the headroom.) No torch here."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from ..units import format_bytes


@dataclass(frozen=True)
class OverHeadroom:
    """The plan of least peak that the headroom alone refused."""

    plan: str  # described ("micro-batch 1, context 512, bf16")
    peak_bytes: int
    budget_bytes: int
    limit_bytes: int  # the budget less the headroom, which the peak is over
    headroom: float
    admitting_headroom: float  # the largest round headroom whose limit holds the peak

    def text(self) -> str:
        return (f"Only the headroom refuses {self.plan}: it peaks at {format_bytes(self.peak_bytes)}, under the "
                f"{format_bytes(self.budget_bytes)} budget but over the {format_bytes(self.limit_bytes)} limit that "
                f"{self.headroom:.0%} headroom leaves; --headroom {self.admitting_headroom:g} would admit it, leaving "
                "less room for what the trials did not see (allocator fragmentation, real batches larger than "
                "make_batch's, other processes on the card), so training may run out of memory")

    def to_json(self) -> dict:
        return {"plan": self.plan, "peak_bytes": self.peak_bytes, "budget_bytes": self.budget_bytes,
                "limit_bytes": self.limit_bytes, "headroom": self.headroom,
                "admitting_headroom": self.admitting_headroom}


def over_headroom(candidates: Iterable[tuple[str, int | None]], budget_bytes: int,
                  headroom: float) -> OverHeadroom | None:
    """Of `candidates` ((plan described, peak bytes) of plans that ran without running out of memory), the one of
    least peak that only the headroom refused (limit < peak <= budget), or None where there is none."""
    limit = int(budget_bytes * (1 - headroom))
    refused = [(peak, plan) for plan, peak in candidates if peak is not None and limit < peak <= budget_bytes]
    if not refused:
        return None
    peak, plan = min(refused)
    return OverHeadroom(plan, peak, budget_bytes, limit, headroom, admitting(peak, budget_bytes))


def admitting(peak_bytes: int, budget_bytes: int) -> float:
    """The largest headroom, in whole percent (else in tenths of a percent, else 0), whose limit (computed as the
    searches compute it) holds `peak_bytes`."""
    room = 1 - peak_bytes / budget_bytes
    for scale in (100, 1000):
        h = math.floor(room * scale) / scale
        while h > 0 and int(budget_bytes * (1 - h)) < peak_bytes:
            h = round(h - 1 / scale, 3)
        if h > 0:
            return h
    return 0.0
