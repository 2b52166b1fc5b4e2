"""The model's own arguments on the command line (probe, estimate): what shapes the model a MODEL argument names -
a Hugging Face model's task, dtype and padding, LoRA adapters, a model file's ARGS - gathered into the
ModelSection a config records."""

from __future__ import annotations

from typing import Annotated

import typer

from ..config.schema import LoraSection, ModelSection
from ..errors import ConfigError, OomtuneError

ModelArg = Annotated[str, typer.Argument(
    help="Your model file (build_model, make_batch, optional hooks); or a Hugging Face model with no Python: its "
    "folder (config.json, weights optional), its config.json, or hf:ORG/NAME[@REVISION].")]
TaskOpt = Annotated[str | None, typer.Option(
    "--task", help="A Hugging Face model's task: causal-lm | sequence-classification | seq2seq (default: from "
    "config.json's architectures).")]
DtypeOpt = Annotated[str | None, typer.Option(
    "--dtype", help="A Hugging Face model's weights as built or loaded: float32 | bfloat16 | float16 (default: "
    "float32, bf16 in a bf16-true plan; never config.json's).")]
PaddingOpt = Annotated[bool, typer.Option(
    "--padding", help="A Hugging Face model's batches carry an attention mask with padding (every other sequence "
    "a quarter padding).")]
LoraROpt = Annotated[int | None, typer.Option(
    "--lora-r", help="Put PEFT LoRA adapters of rank N on the model (the base frozen); QLoRA: add --levers nf4,...")]
LoraAlphaOpt = Annotated[float | None, typer.Option("--lora-alpha", help="LoRA's alpha (default 2 x r).")]
LoraDropoutOpt = Annotated[float | None, typer.Option("--lora-dropout", help="LoRA's dropout (default 0).")]
LoraTargetsOpt = Annotated[str | None, typer.Option(
    "--lora-targets", help="The modules LoRA adapts, comma-separated: q_proj,v_proj (default: PEFT's for the "
    "architecture).")]
ModelArgOpt = Annotated[list[str] | None, typer.Option(
    "--model-arg", help="KEY=VALUE for the model file's ARGS, passed to build_model(**ARGS) (repeatable); recorded "
    "in the config.")]


def model_source(model: str, task: str | None = None, dtype: str | None = None, padding: bool = False,
                 lora_r: int | None = None, lora_alpha: float | None = None, lora_dropout: float | None = None,
                 lora_targets: str | None = None, model_arg: list[str] | None = None) -> ModelSection:
    """MODEL and the options that shape it, checked (a bad value: one line naming the flag)."""
    if lora_r is None and (lora_alpha, lora_dropout, lora_targets) != (None, None, None):
        given = next(f for f, v in (("--lora-alpha", lora_alpha), ("--lora-dropout", lora_dropout),
                                    ("--lora-targets", lora_targets)) if v is not None)
        raise OomtuneError(f"{given} without --lora-r: give --lora-r N to put LoRA adapters on the model")
    args = {}
    for item in model_arg or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise OomtuneError(f"--model-arg {item!r}: expected KEY=VALUE, e.g. n_layer=12")
        args[key.strip()] = value
    try:
        lora = None if lora_r is None else LoraSection(
            r=lora_r, alpha=lora_alpha, dropout=0.0 if lora_dropout is None else lora_dropout,
            targets=tuple(t.strip() for t in lora_targets.split(",")) if lora_targets is not None else ())
        return ModelSection(source=model, task=task, dtype=dtype, padding=padding, lora=lora, args=args)
    except ConfigError as e:  # the section's own checks, named by the flag
        raise OomtuneError(_as_flags(e.message)) from None


def _as_flags(message: str) -> str:
    for key, flag in (("model.lora.r", "--lora-r"), ("model.lora.alpha", "--lora-alpha"),
                      ("model.lora.dropout", "--lora-dropout"), ("model.lora.targets", "--lora-targets"),
                      ("model.task", "--task"), ("model.dtype", "--dtype"),
                      ("model.source", "MODEL")):
        message = message.replace(key, flag)
    return message


def model_flags(section: ModelSection) -> list[str]:
    """The options that made `section`, back as flags (a launcher's workers get the same model)."""
    out = [f"--{k}={v}" for k, v in (("task", section.task), ("dtype", section.dtype)) if v is not None]
    out += ["--padding"] if section.padding else []
    if section.lora is not None:
        lora = section.lora
        out += [f"--lora-r={lora.r}", f"--lora-dropout={lora.dropout}"]
        out += [f"--lora-alpha={lora.alpha}"] if lora.alpha is not None else []
        out += [f"--lora-targets={','.join(lora.targets)}"] if lora.targets else []
    return out + [f"--model-arg={k}={v}" for k, v in section.args.items()]
