"""The rungs past accumulation, climbed only where the usual ones (fp32, amp, checkpointing, fsdp) fit no plan
at the target context (micro-batch 1 with accumulation, at least): each adds one lever to the one before, cheapest
first in speed and exactness, so the last combines them all (the guides' "combine two or more"):

    chunked-loss (a Hugging Face causal LM) -> +bf16-true -> +8bit -> +nf4 (a model with frozen Linear weights)
    -> +offload -> +offload-activations

Chunked cross-entropy comes first: it costs no speed and changes no value beyond float rounding. Beside the chain,
after chunked-loss, one rung steps the optimizer in backward (step-in-backward: no step holds every gradient), also
free in speed and values; it cannot accumulate, so its plan is the whole batch at once or none, and the rungs after
it go on from the one before it (they accumulate).

On a card without bf16 (amp is fp16 there) the offload rungs run in fp32 ("fp32+8bit+offload"): fp16's GradScaler
cannot unscale gradients offload has moved off the device.

A lever the user left out of --levers, one that cannot apply to this model or device, or one whose library is
missing is skipped, with a note saying why (`PastRungs.skipped`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..levers import missing_library
from ..memory.breakdown import StaticMemory
from ..units import format_bytes
from .ladder import Rung

# lever name -> (plan key, what it is): the order they are added in
PAST_LEVERS = {
    "chunked-loss": ("chunked_loss", "chunked cross-entropy"),  # (added before bf16-true: past_rungs)
    "step-in-backward": ("optimizer_in_backward", "the optimizer stepped in backward"),  # (beside the chain)
    "8bit": ("optimizer_8bit", "8-bit AdamW state"),
    "nf4": ("nf4_frozen_weights", "NF4 frozen weights"),
    "offload": ("offload_optimizer", "the optimizer offloaded to host memory"),
    "offload-activations": ("offload_activations", "saved activations offloaded to host memory"),
}


@dataclass
class PastRungs:
    rungs: list[Rung] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # lever -> why the ladder could not use it

    def notes(self) -> tuple[str, ...]:
        return tuple(f"no {lever} rung: {why}" for lever, why in self.skipped.items())


def past_rungs(device, amp_dtype: str, static: StaticMemory, label: str, levers: frozenset[str],
               world_size: int = 1) -> PastRungs:
    """The rungs past accumulation this model, device and --levers allow (see the module doc)."""
    out = PastRungs()
    wanted = [name for name in ("bf16-true", *PAST_LEVERS) if name in levers]  # (chunked-loss: first, below)
    if world_size > 1:
        out.skipped.update(dict.fromkeys(wanted, "the levers past accumulation run on one process (fsdp shards "
                                                 "instead)"))
        return out
    ckpt = static.checkpointing_supported and "checkpointing" in levers
    fields = {"precision": amp_dtype if "amp" in levers else "fp32", "activation_checkpointing": ckpt}
    names: list[str] = []
    if static.weights_dtype == "bfloat16":  # built in bf16: every rung trains bf16-true already (weights_dtype.py)
        fields["precision"] = "bf16-true"
        names.append("bf16-true")
        if "bf16-true" in levers:
            out.skipped["bf16-true"] = (f"{label}'s trained weights are bfloat16, as build_model() returns them: every "
                                        "rung trains bf16-true already")
    if "chunked-loss" in levers:
        if static.chunked_loss_why is not None:
            out.skipped["chunked-loss"] = static.chunked_loss_why
        else:
            fields["chunked_loss"] = True
            names.append("chunked-loss")
            out.rungs.append(Rung("+".join(names), **fields))
    if "step-in-backward" in levers:
        why = _in_backward_why(static, label, fields["precision"])
        if why is None:
            out.rungs.append(Rung("+".join([*names, "step-in-backward"]), **fields, optimizer_in_backward=True))
        else:
            out.skipped["step-in-backward"] = why
    if "bf16-true" in levers and static.weights_dtype != "bfloat16":
        if device.supports_bf16():
            fields["precision"] = "bf16-true"
            names.append("bf16-true")
            out.rungs.append(Rung("+".join(names), **fields))
        else:
            out.skipped["bf16-true"] = f"{device.name} has no native bf16"
    for lever, (key, _) in PAST_LEVERS.items():
        if lever not in levers or key in ("chunked_loss", "optimizer_in_backward"):
            continue
        why = _why_not(lever, static, label, device.kind) or \
            (_no_smaller(static, fields["precision"]) if lever == "8bit" else None)
        if why is not None:
            out.skipped[lever] = why
            continue
        if key == "offload_optimizer" and fields["precision"] == "fp16":
            # fp16's GradScaler unscales the gradients on the device, where offload has already taken them; a card
            # without bf16 offloads in fp32: more activation memory than fp16's, the optimizer's all moved off
            fields["precision"] = "fp32"
            names.insert(0, "fp32")
        fields[key] = True
        names.append(lever)
        out.rungs.append(Rung("+".join(names), **fields))
    return out


def _no_smaller(static: StaticMemory, precision: str) -> str | None:
    """Why 8-bit AdamW would not shrink the state it replaces (bf16 moments on the bf16-true rung, else fp32):
    it quantizes no tensor (each under 4096 elements, or not a multiple of 256), and keeps plain moments for those."""
    now, eight = static.moment_bytes(precision), static.moment_bytes(precision, eight_bit=True)
    if not static.trained_elements or eight < now:
        return None
    return (f"8-bit AdamW keeps plain moments for tensors under 4096 elements (or not a multiple of 256), and all "
            f"{static.trained_elements:,} trained elements are in such tensors (LoRA adapters often are): its state "
            f"would be {format_bytes(eight)}, as without it")


def _in_backward_why(static: StaticMemory, label: str, precision: str) -> str | None:
    if static.steps_in_backward:
        return f"{label} steps {static.steps_in_backward} trained parameters in backward with its own hooks already"
    own = dict(static.optimizer_blocks).get("offload_optimizer")  # (a class none of the levers can rebuild)
    if own is not None:
        return f"{label}'s optimizer() {own}, and may not step one parameter at a time"
    if static.checkpoints_itself:
        return (f"{label}'s model checkpoints itself ({static.checkpoints_itself}): a reentrant checkpoint makes a "
                "shared parameter's gradient twice, and each would be stepped")
    if precision == "fp16":
        return "the amp rungs are fp16 here, whose GradScaler checks every gradient before the step"
    return None


def _why_not(lever: str, static: StaticMemory, label: str, device_kind: str) -> str | None:
    key = PAST_LEVERS[lever][0]
    own = dict(static.optimizer_blocks).get(key)  # the model file's optimizer(), of a class it cannot rebuild
    if own is not None:
        return f"{label}'s optimizer() {own}"
    if key in ("optimizer_8bit", "offload_optimizer") and static.steps_in_backward:
        return (f"{label} steps {static.steps_in_backward} trained parameters in backward with its own hooks "
                "(post-accumulate-grad): the trainer's optimizer, which this lever changes, never sees their "
                "gradients")
    if key == "nf4_frozen_weights" and not static.nf4_elements and static.declared_4bit:
        return f"{label} declares 4-bit weights already ({static.declared_4bit})"
    if key == "nf4_frozen_weights" and not static.nf4_elements:
        return (f"{label} has no frozen nn.Linear (or Conv1D) weights of a whole number of NF4 blocks (64 x 256 "
                "elements; NF4 is for a PEFT LoRA model's base layers, the output head kept) whose forward is "
                "nn.Linear's (a subclass with its own, Falcon's FalconLinear, is left as it is)")
    return missing_library(key, device_kind)
