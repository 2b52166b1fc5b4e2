"""LoRA from the command line (--lora-r and friends): PEFT's LoRA adapters put on the model a model file or a
Hugging Face folder built, the base frozen. Targets that match nothing name the modules there are."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..config.schema import PEFT_TASKS, LoraSection
from ..errors import ModelFileError, first_line


def adaptable(model: nn.Module) -> list[str]:
    """The names (last part) of the layers LoRA can adapt in `model`: Linear, Conv1D (GPT-2), Embedding, Conv."""
    kinds = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d)
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
             if name and (isinstance(m, kinds) or type(m).__name__ == "Conv1D")}
    return sorted(names)


def with_lora(model: nn.Module, lora: LoraSection, task: str | None, label: str) -> nn.Module:
    """`model` wrapped by PEFT with `lora`'s adapters (a classifier's head trained too, as PEFT does for its task)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ModelFileError(f"{label}: --lora-r needs peft: pip install 'oomtune[finetune]'") from None
    kwargs = {"task_type": PEFT_TASKS[task]} if task is not None else {}
    config = LoraConfig(r=lora.r, lora_alpha=2 * lora.r if lora.alpha is None else lora.alpha,
                        lora_dropout=lora.dropout, target_modules=list(lora.targets) or None, **kwargs)
    try:
        return get_peft_model(model, config)
    except Exception as e:  # (PEFT's own: no module matched, no defaults for this architecture)
        there = adaptable(model)
        shown = ", ".join(there[:24]) + (", ..." if len(there) > 24 else "")
        if lora.targets:
            raise ModelFileError(f"{label}: --lora-targets {','.join(lora.targets)} matches no layer LoRA can adapt "
                                 f"(the model has: {shown})") from None
        if "target_modules" in str(e):
            raise ModelFileError(f"{label}: PEFT has no default LoRA targets for this model: give --lora-targets "
                                 f"(the model has: {shown})") from None
        raise ModelFileError(f"{label}: LoRA: {type(e).__name__}: {first_line(e, '(no message)')}") from None


def check_targets(model_file) -> None:
    """Before any trial: LoRA's targets (given, or PEFT's defaults) name layers of the model, built on the meta
    device (no memory, no time). A model that cannot be built there is left to its first trial to say."""
    section = model_file.section
    if section is None or section.lora is None:
        return
    hooks = model_file.module
    if getattr(hooks, "load_weights", False):  # (a Hugging Face model's layers are its config's: no weights read)
        hooks = dataclasses.replace(hooks, load_weights=False)
    try:
        with torch.device("meta"):
            model = hooks.build_model(**(model_file.args or {}))
    except Exception:
        return
    if not isinstance(model, nn.Module):
        return
    names = [name for name, _ in model.named_modules()]
    targets = section.lora.targets
    if targets and any(n == t or n.endswith("." + t) for n in names for t in targets):
        return
    there = adaptable(model)
    shown = ", ".join(there[:24]) + (", ..." if len(there) > 24 else "")
    if targets:
        raise ModelFileError(f"{model_file.label}: --lora-targets {','.join(targets)} matches no layer LoRA can "
                             f"adapt (the model has: {shown})")
    if section.task is not None:  # (a model file's model: PEFT may still find targets by its class)
        raise ModelFileError(f"{model_file.label}: PEFT has no default LoRA targets for this model: give "
                             f"--lora-targets (the model has: {shown})")
