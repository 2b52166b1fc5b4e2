"""Llama 3.2 3B (examples/hf/llama-3.2-3b's config, no weights) with torchtune's output as its recipes have it, for
make bench-published. torchtune's TransformerDecoder upcasts the whole logits to fp32 in its own (eager) forward,
`self.output(h).float()`, where its loss is not chunked; chunked (CEWithChunkedOutputLoss) it returns the bf16
logits in slices and the loss upcasts each. Hugging Face's Llama returns the logits as they are and its loss upcasts
them. ARGS upcast_logits: the first (the recipes without the chunked loss), else as Hugging Face's."""

import json
from pathlib import Path

import torch
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
