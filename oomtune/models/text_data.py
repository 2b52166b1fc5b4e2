"""Real data without Python (`train --data FILE`): a JSONL file of {"text": ...} lines, or a plain text file,
tokenized with the Hugging Face model folder's own tokenizer, packed into sequences of the plan's context (each text
ends with the tokenizer's end-of-text token), the last tenth kept for evaluation. The batches are a causal LM's
(labels = input ids); one pass a `train_batches()` call, in an order drawn from the data's RNG stream, so a resumed
run draws what the first run drew."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..errors import ModelFileError, first_line

EVAL_SHARE = 10  # one sequence in this many (at least one) is kept for evaluation


def read_texts(path: Path) -> list[str]:
    """The texts of a JSONL file (a "text" string on every line) or of a plain text file (one text)."""
    where = f"--data {path}"
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelFileError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{where}: cannot read it as UTF-8 text ({first_line(e, type(e).__name__)})") from None
    if path.suffix not in (".jsonl", ".json"):
        texts = [raw] if raw.strip() else []
    else:
        texts = []
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise ModelFileError(f"{where}: line {n} is not JSON (JSONL: one {{\"text\": ...}} object a line)") \
                    from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise ModelFileError(f"{where}: line {n} has no \"text\" string")
            texts.append(row["text"])
    if not any(t.strip() for t in texts):
        raise ModelFileError(f"{where}: holds no text")
    return texts


def tokenizer_of(folder: Path | None, label: str):
    if folder is None:
        raise ModelFileError(f"{label}: --data needs the model's tokenizer, and a config.json alone has none: give "
                             "the model's folder")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # (no tokenizer files: OSError / ValueError, by version)
        raise ModelFileError(f"{label}: --data needs the folder's tokenizer, and {folder} has none that loads "
                             f"(tokenizer.json / tokenizer_config.json): {first_line(e, type(e).__name__)}") from None


class PackedText:
    """The data's token ids, packed into the train and eval sequences of a context."""

    def __init__(self, path: Path, tokenizer, vocab_size: int, context: int):
        ids: list[int] = []
        end = tokenizer.eos_token_id
        for text in read_texts(path):
            ids += tokenizer(text, add_special_tokens=False)["input_ids"] + ([end] if end is not None else [])
        if ids and max(ids) >= vocab_size:
            raise ModelFileError(f"--data {path}: the tokenizer gives token id {max(ids)}, past the model's "
                                 f"vocab_size {vocab_size}")
        n = len(ids) // context
        if n < 2:
            raise ModelFileError(f"--data {path}: {len(ids):,} tokens make fewer than two sequences of the plan's "
                                 f"context {context} (one to train on, one to evaluate)")
        sequences = torch.tensor(ids[:n * context]).view(n, context)  # (n, context)
        self.digest = hashlib.sha256(sequences.numpy().tobytes()).hexdigest()  # the file, tokenizer and context
        held = max(1, n // EVAL_SHARE)
        self.train, self.eval = sequences[:-held], sequences[-held:]
        self.path, self.context = path, context

    def _check(self, context_length: int) -> None:
        if context_length != self.context:
            raise ValueError(f"--data was packed for context {self.context}, asked for {context_length}")

    def train_batches(self, batch_size: int, context_length: int, device):
        self._check(context_length)
        order = torch.randperm(len(self.train))  # (the data's RNG stream: the trainer swaps it in for each draw)
        for i in range(0, len(order), batch_size):
            ids = self.train[order[i:i + batch_size]].to(device)
            yield {"input_ids": ids, "labels": ids}

    def eval_batches(self, batch_size: int, context_length: int, device):
        self._check(context_length)
        for i in range(0, len(self.eval), batch_size):  # (copied: a slice is a view of every packed sequence, which
            ids = self.eval[i:i + batch_size].to(device, copy=True)  # the cpu device would count while it lives)
            yield {"input_ids": ids, "labels": ids}


def with_data(model_file, data: str | Path, context: int) -> str:
    """Give a Hugging Face causal LM's hooks the data of `data` (its tokenizer's), checked now: bad input is one
    line before the run dir is touched. -> the packed tokens' sha256."""
    from .hf import HFModel

    hooks = model_file.module
    task = hooks.task if isinstance(hooks, HFModel) else None
    if task is None:
        raise ModelFileError(f"{model_file.label}: --data is for a Hugging Face model's folder (its tokenizer); a "
                             "model file gives its data with train_batches()")
    if task != "causal-lm":
        raise ModelFileError(f"{model_file.label}: --data packs text for a causal LM; a {task} model's data needs "
                             "labels: give them with a model file's train_batches() (oomtune init writes one)")
    packed = PackedText(Path(data), tokenizer_of(hooks.folder, model_file.label), hooks.config.vocab_size, context)
    hooks.train_batches, hooks.eval_batches = packed.train_batches, packed.eval_batches
    hooks.data_sha256 = packed.digest
    return packed.digest


def data_digest(model_file) -> dict:
    """What a checkpoint records of --data's tokens (a resume with other tokens is refused)."""
    digest = getattr(model_file.module, "data_sha256", None)
    return {} if digest is None else {"sha256": digest}
