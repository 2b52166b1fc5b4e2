"""What a plan trains where build_model() returns weights in 16 bits: Hugging Face's from_config / from_pretrained
on a config.json saying torch_dtype bfloat16, a model file's `.to(torch.bfloat16)` or `.half()`. Its weights, their
gradients and AdamW's state are in that dtype whatever the plan's precision says, so:

- trained weights all bf16: every usual rung is bf16-true (what it trains: no fp32 copy anywhere), labelled so and
  run so (the bf16-true lever's model.to(bfloat16) and bf16 inputs change nothing more than the buffers' dtype);
  the amp rung (autocast to bf16: what bf16-true already runs under) and the bf16-true rung past accumulation are
  the same as that rung and are left out, with a note;
- trained weights all fp16: no precision names fp16 weights without autocast, so the plans say fp32 (no autocast,
  no GradScaler), with a note saying what that trains;
- the note says how to get fp32 master weights with mixed precision: build the model in fp32 and let amp autocast.
"""

from __future__ import annotations

from ..memory.breakdown import StaticMemory

AMP_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}  # --amp -> the dtype its autocast computes in


def base_precision(static: StaticMemory) -> str:
    """The precision of the ladder's rungs without amp: bf16-true for trained weights built in bf16, else fp32."""
    return "bf16-true" if static.weights_dtype == "bfloat16" else "fp32"


def amp_adds_nothing(static: StaticMemory, amp: str) -> bool:
    """The amp rung would be the rung before it again, or worse: trained weights built in 16 bits, and --amp auto
    (autocast would only add copies of them; on a card without bf16, fp16 copies of bf16 weights) or --amp in their
    own dtype (bf16: what bf16-true runs under already; fp16: a GradScaler over fp16 gradients, which it refuses)."""
    return static.weights_dtype is not None and (amp == "auto" or AMP_DTYPES.get(amp) == static.weights_dtype)


def weights_dtype_notes(label: str, static: StaticMemory, amp_dropped: bool) -> tuple[str, ...]:
    """What a plan trains where build_model() returns weights in 16 bits (`amp_dropped`: the ladder has no amp
    rung for it), and how to get fp32 master weights instead."""
    if static.frozen_dtype is not None:
        return (f"{label}'s frozen weights are {static.frozen_dtype}, as build_model() returns them, and its trained "
                "ones are not: every plan keeps them so (its 'fp32' means no autocast, not fp32 weights); the memory "
                "counts them at their size",)
    dtype = static.weights_dtype
    if dtype is None:
        return ()
    left_out = ["amp rung (autocast would only add copies of them)"] if amp_dropped else []
    cast = ".half()" if dtype == "float16" else ".to(torch.bfloat16)"
    master = ("for fp32 master weights with mixed precision, build the model in fp32 (from_config / from_pretrained "
              f"with dtype=torch.float32, torch_dtype= before transformers 4.56; or without its {cast}) and let the "
              "amp rung autocast")
    if dtype == "bfloat16":
        left_out.append("bf16-true rung past accumulation (it is the case already)")
        return (f"{label}'s trained weights are bfloat16, as build_model() returns them: every plan trains them "
                "bf16-true (weights, gradients and AdamW state in bf16, no fp32 copy; its precision says so), and "
                f"the ladder has no {' and no '.join(left_out)}; {master}",)
    trains = ("every plan trains them, their gradients and AdamW state in float16 (its precision 'fp32' means no "
              "autocast, and no GradScaler: gradients under float16's range become zero)")
    return (f"{label}'s trained weights are float16, as build_model() returns them: {trains}"
            + (f", and the ladder has no {left_out[0]}" if left_out else "") + f"; {master}",)


def precision_note(label: str, precision: str, dtype: str | None, relabel: str) -> str | None:
    """What a plan trains where its precision says fp32 weights (fp32, or autocast's bf16 / fp16) and the model's
    trained weights are built in `dtype` ("bfloat16" / "float16"; None: not all in one 16-bit dtype): a config
    written before the probe labelled such a plan bf16-true, by hand, or a what-if's --precision. `relabel`: how to
    say bf16-true ("set plan.precision: bf16-true", "--precision bf16-true")."""
    if dtype is None or precision == "bf16-true":
        return None
    say = f"{relabel} to say so, or " if dtype == "bfloat16" else ""
    return (f"plan.precision is {precision}, but {label}'s build_model() returns its trained weights in {dtype}: it "
            f"trains them, their gradients and AdamW state in {dtype}, with no fp32 copy ({say}build the model in "
            "fp32 for fp32 master weights under autocast)")
