"""The model file `oomtune init` writes: every hook of the contract, commented, for users who need their own loss
or data. From a Hugging Face folder, config.json or Hub id, it builds that model from its config (the same model
`oomtune probe FOLDER` builds); otherwise a small plain-torch transformer. The text is checked by importing it."""

from __future__ import annotations

HEAD = '''"""{title}

The contract (see `oomtune probe --help`): build_model() and make_batch() are required; every other hook is
optional, and a missing one means oomtune's default. Run it with:

    oomtune estimate {name} --gpu rtx4090        # no GPU needed
    oomtune probe {name}                         # on the GPU: writes best.yaml
    oomtune train --config best.yaml
"""

import torch
'''

HF_BODY = '''from pathlib import Path

from transformers import AutoConfig, {auto}

SOURCE = {source}  # the folder (or Hub id) this was written from
REVISION = {revision!r}  # the Hub revision (None: the default branch)
ARGS = {{"num_hidden_layers": {layers}}}  # build_model's arguments: `--model-arg num_hidden_layers=2` overrides
DEFAULTS = {{"batch": 8, "context": {context}}}  # probe targets where the command line gives none


def build_model(num_hidden_layers):
    torch.manual_seed(0)  # the same weights on every build (a resumed run rebuilds the model)
    config = AutoConfig.from_pretrained(SOURCE, revision=REVISION, num_hidden_layers=num_hidden_layers){fixup}
    model = {auto}.from_config(config)  # the weights too: .from_pretrained(SOURCE, revision=REVISION)
    # LoRA: `--lora-r 16` on the command line, or here:
    #   from peft import LoraConfig, get_peft_model
    #   model = get_peft_model(model, LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    return model


def make_batch(batch_size, context_length, device):
    """The worst case the model will see: full-length sequences (memory is measured on these)."""
    ids = torch.randint(0, {vocab}, (batch_size, context_length), device=device)
    return {{"input_ids": ids, "labels": {labels}}}


# def loss(model, batch):              # default: the model's own .loss
#     return model(**batch).loss
#
# def train_batches(batch_size, context_length, device):   # default: make_batch() (random data)
#     from datasets import load_dataset; ...; yield {{"input_ids": ..., "labels": ...}}
#
# def optimizer(params, lr):           # default: AdamW (fused)
#     return torch.optim.AdamW(params, lr=lr)
'''

TORCH_BODY = '''from torch import nn

ARGS = {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab": 1024}  # `--model-arg n_layer=8` overrides
DEFAULTS = {"batch": 32, "context": 256}  # probe targets where the command line gives none


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = nn.MultiheadAttention(n_embd, n_head, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):  # (B, T, C)
        t = x.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, n_layer, n_embd, n_head, vocab):
        super().__init__()
        self.tok = nn.Embedding(vocab, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))  # checkpointing wraps these
        self.head = nn.Linear(n_embd, vocab)

    def forward(self, ids, targets):
        x = self.tok(ids)  # (B, T, C); add positions of your own
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)  # (B, T, vocab)
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build_model(n_layer, n_embd, n_head, vocab):
    torch.manual_seed(0)  # the same weights on every build (a resumed run rebuilds the model)
    return GPT(n_layer, n_embd, n_head, vocab)


def make_batch(batch_size, context_length, device):
    """The worst case the model will see: full-length sequences (memory is measured on these)."""
    ids = torch.randint(0, ARGS["vocab"], (batch_size, context_length + 1), device=device)
    return ids[:, :-1], ids[:, 1:]  # model(*batch) returns the loss


# def train_batches(batch_size, context_length, device):   # default: make_batch() (random data)
#     ...yield (ids, targets) from your data
#
# def blocks(model):                  # default: the longest ModuleList of alike modules
#     return model.blocks
'''

AUTO = {"causal-lm": "AutoModelForCausalLM", "sequence-classification": "AutoModelForSequenceClassification",
        "seq2seq": "AutoModelForSeq2SeqLM"}


def plain_template(name: str) -> str:
    return HEAD.format(title="A small transformer in plain PyTorch: replace it with yours.", name=name) + \
        TORCH_BODY


def hf_template(name: str, source: str, config, task: str) -> str:
    """`source`: a Hub id, or the folder relative to the model file's own."""
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int):
        raise ValueError("its config has no num_hidden_layers")
    limit = getattr(config, "max_position_embeddings", None)
    context = 512 if not isinstance(limit, int) else min(512, limit)
    labels = {"sequence-classification": f"torch.randint(0, {config.num_labels}, (batch_size,), device=device)",
              "seq2seq": "ids.clone()"}.get(task, "ids")
    title = f"{source} ({config.model_type}, {task}), built from its config: change the loss or the data here."
    on_hub = source.startswith("hf:")
    repo, _, revision = source.removeprefix("hf:").partition("@")
    where = repr(repo) if on_hub else f"str(Path(__file__).resolve().parent / {source!r})"
    fixup = {"sequence-classification": "\n    if config.pad_token_id is None:  # (a decoder's classifier finds "
                                        "the last token by it)\n        config.pad_token_id = 0",
             "seq2seq": "\n    if config.decoder_start_token_id is None:\n        config.decoder_start_token_id = "
                        "config.pad_token_id or 0"}.get(task, "")
    return HEAD.format(title=title, name=name) + HF_BODY.format(
        auto=AUTO[task], source=where, revision=revision or None, layers=layers, context=context,
        vocab=config.vocab_size, labels=labels, fixup=fixup)
