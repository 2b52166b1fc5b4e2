"""litgpt's single-GPU fine-tunes with litgpt's own model code, for make bench-published's litgpt rows (its
tutorials/resource-tables.md, October 2023, one A100 40GB, bf16-true). ARGS method:
- "lora" (`finetune/lora.py`): LoRA r=8, alpha 16, dropout 0.05 on the query and value parts of the fused qkv
  projection;
- "adapter" (`finetune/adapter.py`): LLaMA-Adapter, a 10-token prompt and a gate in each layer from the third;
- "adapter_v2" (`finetune/adapter_v2.py`): that, plus a trained bias and scale on every Linear.
The rest frozen by litgpt's own mark_only_*_as_trainable; the output layer run on slices of 128 positions
(`lm_head_chunk_size=128`) and litgpt's chunked_cross_entropy over the slices, as the scripts' training step does;
torch's AdamW (not fused), as litgpt builds it. No activation checkpointing (single device). The rope cache is
built for the longest sample, as litgpt sets `model.max_seq_length` (ARGS max_seq_length: a longer --context needs
`--model-arg max_seq_length=N`, else litgpt's forward refuses it). Needs litgpt (make
bench-published installs it without its dependencies); this is litgpt 0.5.13's code, which may keep other memory
than the October 2023 commit that was measured."""

import importlib

import torch

ARGS = {"method": "lora", "name": "Llama-2-7b-hf", "max_seq_length": 1304}
DEFAULTS = {"batch": 1, "context": 1304, "min_context": 1304}
LORA = {"lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.05, "lora_query": True, "lora_key": False,
        "lora_value": True, "lora_projection": False, "lora_mlp": False, "lora_head": False}


def build_model(method="lora", name="Llama-2-7b-hf", max_seq_length=1304):
    lib = importlib.import_module(f"litgpt.{method}")
    model = lib.GPT(lib.Config.from_name(name, **(LORA if method == "lora" else {})))
    getattr(lib, f"mark_only_{method}_as_trainable")(model)
    model.max_seq_length = max_seq_length
    return model


def make_batch(batch_size, context_length, device):
    ids = torch.randint(0, 32000, (batch_size, context_length), device=device)
    return ids, ids.clone()


def loss(model, batch):
    from litgpt.utils import chunked_cross_entropy

    input_ids, targets = batch
    for m in model.modules():  # the adapter's prompt keys and values, made afresh from this step's weights (litgpt
        if getattr(m, "adapter_kv_cache", None) is not None:  # 0.5.13 keeps them across calls, its graph with them,
            m.adapter_kv_cache = None  # and a second step's backward would run through the first's)
    logits = model(input_ids, lm_head_chunk_size=128)
    logits[-1] = logits[-1][..., :-1, :]  # (the scripts' shift: output n predicts token n+1)
    return chunked_cross_entropy(logits, targets[..., 1:])


def optimizer(params, lr):
    return torch.optim.AdamW(params, lr=lr)
