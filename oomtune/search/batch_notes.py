"""What make_batch() shows of the batches a plan is measured on, where it is not what training will run: tensors off
its device, no sequence of the context's length, an attention mask transformers drops. An error where it ignores
its batch size."""

from __future__ import annotations

from types import ModuleType

import torch

from ..memory.devices import Device
from ..model_file import ModelFile


def batch_notes(model_file: ModelFile, device: Device, context: int) -> tuple[str, ...]:
    """What make_batch() shows for one sequence (model_file.sample_tensors): on the simulated devices, tensors not
    on its `device` (a GPU's probe would refuse them); on any, no sequence of the context's length. One that
    ignores its batch_size (the same shapes for 1 and 2) is an error."""
    sample = model_file.sample_tensors(context)
    if sample is None:
        return ()
    tensors, on_meta = sample
    two = model_file.sample_tensors(context, batch_size=2)
    if tensors and two is not None and [t.shape for t in two[0]] == [t.shape for t in tensors]:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise model_file.fail("make_batch", f"returned the same shapes for batch_size 1 and 2 ({shapes}): it must "
                                            "return batch_size examples, or every plan is measured at the wrong size")
    notes: tuple[str, ...] = ()
    if on_meta and device.kind != "cuda" and any(t.device.type != "meta" for t in tensors):
        notes += (f"{model_file.label}'s make_batch() ignores its device argument (asked for PyTorch's meta device, "
                  "which allocates nothing, it returned tensors elsewhere): this device's tensors are the CPU's, so "
                  "it ran here, but on a GPU its batch would be on the wrong device: create the tensors with "
                  "device=device",)
    if context > 1 and not any(context in t.shape or context + 1 in t.shape for t in tensors):
        notes += (f"{model_file.label}'s make_batch(batch_size, {context}, device) returned no tensor with a "
                  f"dimension of {context}: plans are sized for every sequence at full length, so where yours are "
                  "shorter than asked (padded to the longest in the batch), real data at full length may not fit; "
                  "make_batch should return that worst case",)
    return notes + all_ones_mask_note(model_file, context)


def all_ones_mask_note(model_file: ModelFile, context: int) -> tuple[str, ...]:
    """A dict batch whose `attention_mask` is all ones (read on the cpu, for two sequences): transformers drops such
    a mask and runs attention unmasked, where a padded batch's mask is built and takes a costlier path (a BERT's
    tensor peak: +20% on an RTX 3060's rules, measured). Only the user knows whether their batches are padded."""
    if not _uses_transformers(model_file):
        return ()
    try:
        batch = model_file.module.make_batch(2, context, torch.device("cpu"))
    except (Exception, SystemExit):
        return ()
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    if not isinstance(mask, torch.Tensor) or mask.numel() == 0 or not bool((mask != 0).all()):
        return ()
    return (f"{model_file.label}'s make_batch() gives an attention_mask of all ones, which transformers drops (the "
            "attention then runs unmasked): if your real batches are padded, set a 0 in it (e.g. mask[:, -1] = 0) so "
            "that plans are measured with the mask training will build, which can take more memory (or less: see the "
            "note on grouped query heads, where there is one)",)


def _uses_transformers(model_file: ModelFile) -> bool:
    """Whether the model file imports from transformers (or peft): what it binds at its top level comes from there.
    Its own attention (nn.MultiheadAttention with a key_padding_mask) measures the same with any mask."""
    for value in vars(model_file.module).values():
        name = value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", None)
        if isinstance(name, str) and name.split(".")[0] in ("transformers", "peft"):
            return True
    return False
