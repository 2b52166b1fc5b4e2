"""What each lever of a plan takes off its peak (`estimate --breakdown`): the plan estimated again with that one
lever off and every other as it is, on the same device and card rules. A lever's saving is then the peak without it
less the plan's peak: what turning it off would cost, the other levers staying on. Savings measured that way need not
add up to the difference from a plan with none of them (two levers can save the same bytes: checkpointing and
activation offloading both take the saved activations), and a lever can save nothing where the peak is elsewhere
(chunked cross-entropy where the peak is the optimizer step), which is itself worth knowing.

Levers: each plan key past accumulation that is on (LEVER_LABELS), activation checkpointing, and the precision (a
plan in bf16-true against bf16 autocast with fp32 weights; autocast against fp32). Accumulation is not a lever here:
at a given micro-batch it changes no memory; the sharding is the ranks' business (estimate --world-size)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ..config.schema import LEVER_LABELS, TRIAL_STEPS, ConfigError, Plan
from ..errors import OomtuneError, first_line
from ..memory.breakdown import breakdown, static_memory
from ..memory.devices import FakeDevice
from ..model_file import ModelFile
from .trial import computing_where_needed

LOWER_PRECISION = {"bf16-true": ("bf16", "bf16 weights (bf16-true)"), "bf16": ("fp32", "bf16 autocast"),
                   "fp16": ("fp32", "fp16 autocast")}  # precision -> (the plan without it, the lever's label)


@dataclass(frozen=True)
class Saving:
    lever: str  # the plan key turned off ("compile", "precision")
    label: str  # as a plan's description names it
    peak_bytes: int | None  # the plan's peak with this lever off (None: that plan cannot be made, `why`)
    saved_bytes: int | None  # peak_bytes less the plan's own
    why: str | None = None


def without_each(plan: Plan, weights_dtype: str | None = None) -> list[tuple[str, str, Plan | str]]:
    """(plan key, label, the plan with that lever off, or why there is none) for each lever the plan uses;
    `weights_dtype`: the 16-bit dtype build_model() returns every trained weight in, where it does (a plan without
    bf16-true then trains them in it all the same: nothing to compare)."""
    labels = {**LEVER_LABELS, "compile": "torch.compile"}
    offs: list[tuple[str, str, dict]] = [(key, label, {key: False}) for key, label in labels.items()
                                         if getattr(plan, key)]
    if plan.activation_checkpointing:
        offs.append(("activation_checkpointing", "activation checkpointing", {"activation_checkpointing": False}))
    if plan.precision in LOWER_PRECISION:
        lower, label = LOWER_PRECISION[plan.precision]
        offs.append(("precision", label, {"precision": lower}))
    out: list[tuple[str, str, Plan | str]] = []
    for key, label, change in offs:
        if key == "precision" and plan.precision == "bf16-true" and weights_dtype is not None:
            out.append((key, label, f"build_model() returns its trained weights in {weights_dtype}: without "
                                    "bf16-true they stay so"))
            continue
        try:
            out.append((key, label, replace(plan, **change)))
        except ConfigError as e:  # (a lever another one needs: none today, but the plan says)
            out.append((key, label, str(e)))
    return out


def lever_savings(model_file: ModelFile, plan: Plan, device: FakeDevice, peak_bytes: int,
                  steps: int = TRIAL_STEPS, on_lever: Callable[[str], None] | None = None) -> tuple[Saving, ...]:
    """Each lever's saving against `peak_bytes` (the plan's own peak, as its breakdown says), one estimate each;
    `on_lever(label)` is told before each (they take as long as the plan's own estimate)."""
    out = []
    for key, label, other in without_each(plan, static_memory(model_file).weights_dtype):
        if isinstance(other, str):
            out.append(Saving(key, label, None, None, other))
            continue
        if on_lever is not None:
            on_lever(label)
        try:
            bd, _ = computing_where_needed(device, model_file.label,
                                           lambda p=other: breakdown(model_file, p, device, steps))
        except OomtuneError as e:  # (that plan cannot be measured here: the host ran out, say; said, not fatal)
            out.append(Saving(key, label, None, None, first_line(e)))
            continue
        out.append(Saving(key, label, bd.peak_bytes, bd.peak_bytes - peak_bytes))
    return tuple(out)
