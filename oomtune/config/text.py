"""A config's YAML text: read strictly (a key given twice is an error), written with a comment on every key,
and, when oomtune rewrites a hand-edited config, every top-level section whose values the rewrite does not change
kept word for word (comments, spacing, order)."""

from __future__ import annotations

import re

COMMENTS = {
    "model": "what the model is and what shapes it: check, train and export rebuild it from this",
    "model.source": ("a model file, a Hugging Face folder or config.json (relative to this file's folder, unless "
                     "absolute), or hf:ORG/NAME[@REVISION]"),
    "model.sha256": ("of the model file / config.json when written: train and export refuse a changed one (delete "
                     "this to accept)"),
    "model.task": "causal-lm | sequence-classification | seq2seq",
    "model.dtype": "the weights as built or loaded: float32 | bfloat16 | float16",
    "model.padding": "batches carry an attention mask with padded positions",
    "model.lora": "PEFT LoRA adapters on the model (the base frozen)",
    "model.lora.alpha": "the adapters' scale is alpha / r",
    "model.lora.targets": "the modules adapted ([]: PEFT's defaults for the architecture)",
    "model.args": "the model file's ARGS given with --model-arg",
    "plan.micro_batch_size": "examples per forward/backward pass",
    "plan.context_length": "tokens per example",
    "plan.precision": ("fp32 | bf16 | fp16 (autocast keeps fp32 weights; fp16 adds a GradScaler) | bf16-true "
                       "(weights, gradients, AdamW state all bf16: 8 bytes a parameter, not 16; an update under "
                       "~1/256 of its weight is rounded away)"),
    "plan.activation_checkpointing": "less memory, ~30% more compute (blocks recomputed in backward)",
    "plan.grad_accum_steps": "micro-batches per optimizer step; more = less memory, same step for an example-mean loss",
    "plan.world_size": "ranks (processes, one per GPU) the plan is for: oomtune train --nproc-per-node",
    "plan.sharding": "none | ddp (replicated on every rank) | fsdp (weights, grads, optimizer state sharded)",
    "plan.optimizer_8bit": "AdamW moments in 8 bits: 2 bytes a parameter instead of 8; updates carry ~1-5% noise",
    "plan.offload_optimizer": "optimizer state and step in host RAM, gradients moved there: slower steps",
    "plan.offload_activations": "tensors saved for backward held in host RAM: a copy each way per step",
    "plan.nf4_frozen_weights": "frozen Linear weights in 4-bit NF4 (QLoRA): ~0.5 byte each, dequantized per use",
    "plan.chunked_loss": ("a causal LM's cross-entropy over 8 slices of the sequence, the output layer run on each, "
                          "each upcast to fp32 alone: the logits never whole (Hugging Face causal LMs)"),
    "plan.optimizer_in_backward": ("each parameter updated in backward as its gradient is made, then freed: no step "
                                   "holds every gradient; no accumulation, clipping or fp16"),
    "plan.compile": ("each block (transformer layer) and the loss torch.compile'd, as torchtune compiles: fewer "
                     "tensors saved for backward, fused kernels' intermediates never in memory"),
    "plan.global_batch_size": "micro_batch_size x grad_accum_steps x world_size: what the optimizer sees",
    "train.steps": "optimizer steps",
    "train.lr": "peak learning rate, after warmup",
    "train.min_lr": "cosine decay ends here",
    "train.warmup_steps": "linear warmup from 0",
    "train.clip_grad_norm": "null = no clipping",
    "train.eval_interval": "optimizer steps between evaluations",
    "train.eval_steps": "batches per evaluation",
    "train.checkpoint_interval": "optimizer steps between checkpoints",
    "train.log_every_n_steps": "optimizer steps between metric lines",
    "train.run_dir": "checkpoints and metrics.jsonl go here",
    "train.data": "JSONL ({\"text\": ...} a line) or text, packed by the model folder's tokenizer (null: its hooks)",
    "train.save_adapter": ("a PEFT adapter (adapter/) or a Hugging Face model (model/) is saved at the end; true: at "
                           "every checkpoint too"),
    "found_by.estimated": "true: predicted on the fake device, never measured",
    "found_by.budget_bytes": "memory the search was allowed to use",
    "found_by.headroom": "fraction of the budget kept free (fragmentation, longer batches)",
    "found_by.peak_bytes": "measured peak of the plan",
    "found_by.breakdown": "what the peak is made of; the parts sum to tensor_peak_bytes",
    "found_by.host_peak_bytes": "host RAM the plan held at most: offloaded parts, an NF4 model built before quantizing",
    "found_by.notes": "how the plan was measured, where that is not what one would assume",
    "found_by.card": "the card's rules a simulated device accounted by (--gpu): autocast, attention, allocator",
    "found_by.prior": "how the probe's trials were chosen: certified from the estimate, or why not",
    "found_by.margin": "the flat --margin the probe accounted by beside its card (or on fake); check and train use it",
    "found_by.checkpointing_via": "switch: the model's own (Hugging Face's); blocks: the blocks oomtune wrapped",
    "found_by.threads": "torch's threads the cpu device measured tokens/s with; train on cpu uses as many",
    "found_by.breakdown.phase": "the step's phase at the peak: forward | backward | optimizer",
    "found_by.breakdown.margin": "added for what tensors do not show on a GPU: CUDA context, workspaces, allocator",
    "found_by.breakdown.peak_bytes": "tensor_peak_bytes + margin_bytes",
}


def parse(text: str):
    """A config's YAML as oomtune reads it, everywhere: PyYAML's safe loader, refusing a key given twice."""
    import yaml

    return yaml.load(text, Loader=unique_keys_loader())


MAX_DEPTH = 50  # nested collections a config may hold (oomtune's are 3 deep: found_by.trials[i].key)


def unique_keys_loader():
    """PyYAML's safe loader, refusing a key given twice in one mapping (plain PyYAML keeps the last one, so
    a second `model:` or `lr:` would silently win), an alias (`*name`: a 482-byte file of nested aliases expands
    to hundreds of megabytes) and collections nested past MAX_DEPTH (PyYAML recurses: 20,000 levels were a
    RecursionError). oomtune writes neither."""
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise yaml.composer.ComposerError(
                    None, None, f"an alias (*{event.anchor}) repeats another node: an oomtune config holds plain "
                    "values, write them out", event.start_mark)
            depth = self.__dict__.setdefault("_depth", 0)
            if depth >= MAX_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"collections nested more than {MAX_DEPTH} deep",
                                                  self.peek_event().start_mark)
            self._depth = depth + 1
            try:
                return super().compose_node(parent, index)
            finally:
                self._depth = depth

        def construct_mapping(self, node, deep=False):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: PyYAML merges these itself
                    continue
                key, line = self.construct_object(key_node, deep=deep), key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"key {key!r} appears twice (lines {seen[key]} and {line})",
                            key_node.start_mark)
                    seen[key] = line
                except TypeError:  # an unhashable key: PyYAML's own error follows
                    continue
            return super().construct_mapping(node, deep)

    return UniqueKeys


_KEY = re.compile(r"([A-Za-z_][\w.-]*)\s*:(\s|$)")  # a top-level key at column 0
_TOP_LEVEL = re.compile(r"[^\s#]")  # a line that starts a top-level key (or a YAML marker), not a comment


def _blocks(lines: list[str]) -> dict[str, tuple[int, int, int]]:
    """Top-level key -> (lead, start, end): lines [start, end) hold the key's block, [lead, start) the column-0
    comments right above it (none for the file's first key: those are the file's header, which oomtune writes).
    Comments and blank lines at a block's end belong to what follows. A key seen twice is left out (not YAML
    oomtune can keep)."""
    found: dict[str, tuple[int, int, int]] = {}
    seen: set[str] = set()
    starts = [i for i, line in enumerate(lines) if _TOP_LEVEL.match(line)]
    for n, start in enumerate(starts):
        m = _KEY.match(lines[start])
        if not m:
            continue
        end = starts[n + 1] if n + 1 < len(starts) else len(lines)
        while end - 1 > start and (not lines[end - 1].strip() or lines[end - 1].startswith("#")):
            end -= 1
        lead = start
        while n > 0 and lead - 1 >= 0 and lines[lead - 1].startswith("#"):
            lead -= 1
        key = m[1]
        if key in seen:
            found.pop(key, None)
        else:
            found[key] = (lead, start, end)
        seen.add(key)
    return found


def keep_unchanged_text(old_text: str, new_text: str) -> str:
    """`new_text` with each top-level block that `old_text` also has, and whose values are the same, taken from
    `old_text` as written (with the comments right above it); a block whose values differ is `new_text`'s. The
    result always parses to exactly what `new_text` does."""
    import yaml

    try:
        want = parse(new_text)
    except yaml.YAMLError:
        return new_text
    old_lines = old_text.splitlines(keepends=True)
    if old_lines and not old_lines[-1].endswith("\n"):
        old_lines[-1] += "\n"
    old_blocks = _blocks(old_lines)
    text = new_text
    for key in list(_blocks(new_text.splitlines(keepends=True))):
        if key not in old_blocks:
            continue
        lines = text.splitlines(keepends=True)
        lead, start, end = _blocks(lines)[key]
        o_lead, o_start, o_end = old_blocks[key]
        spliced = "".join(lines[:lead] + old_lines[o_lead:o_end] + lines[end:])
        try:
            same = parse(spliced) == want
        except yaml.YAMLError:
            same = False
        if same:
            text = spliced
    return text
