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
    return (f"even {plan.describe(with_global=False)} peaks at {format_bytes(bd.peak_bytes)} > {allowed}: weights "
            f"+ gradients + {static.optimizer_name} state {format_bytes(floor)}, the rest "
            f"{format_bytes(bd.peak_bytes - bd.margin_bytes - floor)}{margin_text} (peak in {bd.phase})")


def levers_that_help(bd: MemoryBreakdown, static: StaticMemory, limit_bytes: int, margin: Margin, headroom: float,
                     plan: Plan, past=None) -> list[str]:
    """What would make the smallest plan (`plan`, on which `bd` was measured) fit, with the bytes each saves
    (estimates, not measurements): only levers that plan does not use already, each with why the ladder could not
    (`past.skipped`: left out of --levers, not for this model or device, its library missing)."""
    need = bd.peak_bytes - limit_bytes  # bytes to save, margin included
    tensor_room = margin.tensor_budget(limit_bytes)  # tensor bytes the limit allows
    skipped = past.skipped if past is not None else {}
    out: list[str] = []

    def enough(saved: int) -> str:
        # the peak less what the lever saves, with the margin the device adds to it (a card's: the allocator model's
        # reserved bytes less the same, its rounding and cached blocks kept)
        reserved = bd.modelled_reserved_bytes
        after = margin.total(bd.tensor_peak_bytes - saved, reserved - saved if reserved is not None else None)
        return "enough" if after <= limit_bytes else "not enough alone"

    def why(lever: str) -> str:
        return f"; the ladder could not use it: {skipped[lever]}" if lever in skipped else ""

    opt = bd.optimizer_state_bytes
    if plan.precision != "bf16-true":  # autocast keeps fp32 weights, their gradients and fp32 optimizer state
        saved = (bd.parameters_bytes + bd.gradients_bytes + (0 if plan.optimizer_8bit else opt)) // 2
        out.append(f"bf16 weights, gradients and optimizer state, no fp32 copy (--levers bf16-true): saves about "
                   f"{format_bytes(saved)} ({enough(saved)}){why('bf16-true')}")
    # 8-bit AdamW keeps plain moments for the tensors it does not quantize (elements not counted: a flat 4x)
    saved = opt - static.moment_bytes(plan.precision, eight_bit=True) if static.trained_elements else opt * 3 // 4
    if saved > 0 and not plan.optimizer_8bit and not plan.offload_optimizer:
        out.append(f"8-bit optimizer state (--levers 8bit): {static.optimizer_name} state {format_bytes(opt)} -> "
                   f"{format_bytes(opt - saved)}, saves {format_bytes(saved)} ({enough(saved)}){why('8bit')}")
    if (opt or bd.gradients_bytes) and not plan.offload_optimizer:
        saved = opt + bd.gradients_bytes
        out.append(f"CPU offload of the optimizer and its gradients (--levers offload): saves "
                   f"{format_bytes(saved)} of GPU memory, costs host RAM and PCIe time ({enough(saved)})"
                   f"{why('offload')}")
    if static.chunked_loss_why is None and not plan.chunked_loss:
        out.append(f"a causal LM's cross-entropy in slices (--levers chunked-loss): its fp32 logits and their gradient "
                   f"never whole{why('chunked-loss')}")
    if bd.gradients_bytes and not (plan.optimizer_in_backward or plan.offload_optimizer or static.steps_in_backward):
        out.append(f"the optimizer stepped in backward (--levers step-in-backward): the gradients at the peak "
                   f"({format_bytes(bd.gradients_bytes)}) applied and freed as they are made; the whole batch at "
                   f"once, no accumulation or clipping{why('step-in-backward')}")
    if static.nf4_elements and not plan.nf4_frozen_weights:
        out.append(f"4-bit frozen weights (--levers nf4): {static.nf4_elements:,} frozen Linear weights at about "
                   f"half a byte each{why('nf4')}")
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
        if plan.activation_checkpointing or static.checkpoints_itself or static.checkpointing_breaks:
            pass  # checkpointed already (the model's own checkpointing runs in every plan), or it cannot be
        elif static.checkpointing_supported:  # the model has blocks (an HF model's own switch, a ModuleList, ...)
            out.append("activation checkpointing (--checkpointing with --micro-batch; the ladder's checkpointing "
                       "lever)")
        else:
            out.append("activation checkpointing: define blocks(model) in the model file so oomtune can wrap them")
        if bd.activations_bytes and not plan.offload_activations:
            out.append(f"saved activations offloaded to host memory (--levers offload-activations): "
                       f"{format_bytes(bd.activations_bytes)}{why('offload-activations')}")
        if plan.context_length > 1:  # a model whose context is 1 has none shorter
            out.append(f"a shorter context (--min-context): activations + temporaries are {format_bytes(act)}")
    bigger = sorted((g for g in GPUS if int(g.memory_bytes * (1 - headroom)) >= max(bd.peak_bytes, limit_bytes + 1)),
                    key=lambda g: g.memory_bytes)  # the smallest that would hold it first
    if bigger:
        out.append(f"a larger GPU: {', '.join(g.name for g in bigger[:3])}" + (" or larger" if bigger[3:] else ""))
    return out

