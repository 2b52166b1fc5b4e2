"""When nothing fits: why (the floor of weights, gradients and optimizer state, or the smallest plan's peak and
what it is made of), and the levers that would help, with the bytes each would save (estimates)."""

from __future__ import annotations

import math

from ..config.schema import MemoryBreakdown, Plan
from ..units import format_bytes
from .breakdown import StaticMemory
from .cards import GPUS
from .margin import Margin


def why_nothing_fits(bd: MemoryBreakdown, plan: Plan, static: StaticMemory, limit_bytes: int, budget_bytes: int,
                     headroom: float, margin: Margin) -> str:
    allowed = f"{format_bytes(limit_bytes)} allowed ({format_bytes(budget_bytes)} budget, {headroom:.0%} headroom)"
    if margin.total(static.floor_bytes) > limit_bytes:
        over = margin.overhead(static.floor_bytes)
        plus = f" + margin {format_bytes(over)}" if over else ""
        return f"{static.describe()}{plus} > {allowed}, before a single activation"
    margin_text = f" + margin {format_bytes(bd.margin_bytes)}" if bd.margin_bytes else ""
    floor = bd.parameters_bytes + bd.gradients_bytes + bd.optimizer_state_bytes
    return (f"even {plan.describe()} peaks at {format_bytes(bd.peak_bytes)} > {allowed}: weights + gradients + "
            f"{static.optimizer_name} state {format_bytes(floor)}, the rest "
            f"{format_bytes(bd.peak_bytes - bd.margin_bytes - floor)}{margin_text} (peak in {bd.phase})")


def levers(bd: MemoryBreakdown, static: StaticMemory, limit_bytes: int, margin: Margin, headroom: float,
           checkpointing_used: bool, context_length: int = 2) -> list[str]:
    """What would make the smallest plan fit, with the bytes each saves (estimates, not measurements)."""
    need = bd.peak_bytes - limit_bytes  # bytes to save, margin included
    tensor_room = margin.tensor_budget(limit_bytes)  # tensor bytes the limit allows
    out: list[str] = []

    def enough(saved_tensor_bytes: int) -> str:
        return "enough" if bd.tensor_peak_bytes - saved_tensor_bytes <= tensor_room else "not enough alone"

    opt = bd.optimizer_state_bytes
    if opt:
        saved = opt * 3 // 4
        out.append(f"8-bit optimizer state (bitsandbytes AdamW8bit): {static.optimizer_name} state "
                   f"{format_bytes(opt)} -> {format_bytes(opt - saved)}, saves {format_bytes(saved)} ({enough(saved)})")
        out.append(f"CPU offload of the optimizer state (DeepSpeed ZeRO-Offload, FSDP CPUOffload): saves "
                   f"{format_bytes(opt)} of GPU memory, costs host RAM and PCIe time ({enough(opt)})")
    sharded = bd.parameters_bytes + bd.gradients_bytes + opt
    rest = bd.tensor_peak_bytes - sharded
    if sharded and tensor_room > rest:
        n = max(2, math.ceil(sharded / (tensor_room - rest)))
        out.append(f"shard weights, gradients and optimizer state across {n} GPUs (FSDP / DeepSpeed ZeRO-3): "
                   f"{format_bytes(sharded)} -> {format_bytes(sharded // n)} per GPU")
    elif sharded:
        out.append("sharding across GPUs (FSDP / ZeRO-3) cannot help alone: activations and temporaries "
                   f"{format_bytes(rest)} already exceed what the limit leaves")
    act = bd.activations_bytes + bd.temporaries_bytes
    if act and act >= need:
        if not checkpointing_used:
            out.append("activation checkpointing: define blocks(model) in the model file so oomtune can wrap them")
        if context_length > 1:  # a model whose context is 1 has none shorter
            out.append(f"a shorter context (--min-context): activations + temporaries are {format_bytes(act)}")
    bigger = [g.name for g in GPUS if int(g.memory_bytes * (1 - headroom)) >= max(bd.peak_bytes, limit_bytes + 1)]
    if bigger:
        out.append(f"a larger GPU: {', '.join(bigger)}")
    return out

