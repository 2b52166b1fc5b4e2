"""Llama 3.2 3B (examples/hf/llama-3.2-3b's config, no weights) with torchtune's output as its recipes have it, for
make bench-published. torchtune's TransformerDecoder upcasts the whole logits to fp32 in its own (eager) forward,
`self.output(h).float()`, where its loss is not chunked; chunked (CEWithChunkedOutputLoss) it returns the bf16
logits in slices and the loss upcasts each. Hugging Face's Llama returns the logits as they are and its loss upcasts
them. ARGS upcast_logits: the first (the recipes without the chunked loss), else as Hugging Face's.

The loss is the full fine-tune recipe's (full_finetune_single_device, as it stood when the table was published and
since): the labels shifted by one with an ignored label appended, the logits flattened, nn.CrossEntropyLoss, eager
even with compile on. That recipe calls `training.compile_loss(self._loss_fn)` and drops what it returns, and for a
loss other than the chunked one compile_loss returns a new, compiled module: the recipe's loss stays the eager one.
With `--compile` oomtune compiles the layers and leaves a model file's own loss eager: the same."""

import json
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = Path(__file__).parents[2] / "examples" / "hf" / "llama-3.2-3b" / "config.json"
ARGS = {"upcast_logits": True}


def _upcast(module, inputs, output):
    return output.float()  # (a forward hook's result replaces the module's output)


def build_model(upcast_logits=True):
    config = LlamaConfig(**json.loads(CONFIG.read_text()))
    model = LlamaForCausalLM(config)
    if upcast_logits:
        model.lm_head.register_forward_hook(_upcast)
    return model


def make_batch(batch_size, context_length, device):
    ids = torch.randint(0, 128256, (batch_size, context_length), device=device)
    return {"input_ids": ids, "labels": ids}


def loss(model, batch):
    labels = batch["labels"]
    logits = model(input_ids=batch["input_ids"]).logits
    ignored = torch.full((labels.shape[0], 1), -100, dtype=labels.dtype, device=labels.device)
    labels = torch.hstack((labels[..., 1:], ignored)).reshape(-1)
    value = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels, ignore_index=-100)
    del logits  # (as the recipe: its logits freed before backward)
    return value
