"""A Hugging Face model with no model file: its config read from a folder, a config.json or the Hub, the model built
from it (or loaded with its weights, where the folder has them and training asks for them), and batches of its
vocabulary with the labels its task needs. An HFModel has the hooks a model file has (build_model, make_batch,
DEFAULTS, MAX_CONTEXT); the loss, the blocks and the optimizer are the defaults a model file gets."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config.schema import HUB
from ..errors import ModelFileError, first_line

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
_SUFFIXES = (("ForCausalLM", "causal-lm"), ("LMHeadModel", "causal-lm"),
             ("ForSequenceClassification", "sequence-classification"), ("ForConditionalGeneration", "seq2seq"))
FINETUNE_EXTRA = "pip install 'oomtune[finetune]'"


def _transformers(label: str):
    try:
        import transformers
    except ImportError:
        raise ModelFileError(f"{label}: a Hugging Face model needs transformers: {FINETUNE_EXTRA}") from None
    return transformers


def _task_models(transformers) -> dict[str, dict[str, str]]:
    """task -> {model_type: the class transformers builds for it}."""
    names = transformers.models.auto.modeling_auto
    return {"causal-lm": names.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            "sequence-classification": names.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
            "seq2seq": names.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES}


def read_config(where: Path, label: str):
    """The model's config (transformers' class for its model_type) from a folder holding config.json or the file."""
    transformers = _transformers(label)
    file = where / "config.json" if where.is_dir() else where
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelFileError(f"{label}: cannot read {file.name}: {first_line(e, type(e).__name__)}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise ModelFileError(f"{label}: {file.name} names no model_type: it is not a Hugging Face model's config")
    if raw["model_type"] not in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES:
        raise ModelFileError(f"{label}: {file.name} has model_type {raw['model_type']!r}, which transformers "
                             f"{transformers.__version__} does not know")
    try:
        return transformers.AutoConfig.from_pretrained(str(file))
    except Exception as e:  # (a config the model_type's class refuses: a wrong value's own message)
        raise ModelFileError(f"{label}: {file.name}: {type(e).__name__}: {first_line(e, '(no message)')}") from None


def task_of(config, asked: str | None, label: str) -> str:
    """--task where given (and the model_type can do it), else the task of the config's architectures, else the
    one its kind does: seq2seq for encoder-decoders, classification for encoders (BERT), causal LM for the rest."""
    transformers = _transformers(label)
    kind = config.model_type
    can = [task for task, types in _task_models(transformers).items() if kind in types]
    if asked is not None:
        if asked not in can:
            raise ModelFileError(f"{label}: a {kind} model cannot do --task {asked} (transformers has it for: "
                                 f"{', '.join(can) or 'none of causal-lm, sequence-classification, seq2seq'})")
        return asked
    for architecture in getattr(config, "architectures", None) or ():
        for suffix, task in _SUFFIXES:
            if architecture.endswith(suffix) and task in can:
                return task
    masked = transformers.models.auto.modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    for task, wanted in (("seq2seq", True), ("sequence-classification", kind in masked), ("causal-lm", True)):
        if task in can and wanted:
            return task
    if can:
        return can[0]
    raise ModelFileError(f"{label}: transformers has no causal LM, sequence classifier or seq2seq model for a "
                         f"{kind} model")


def hub_folder(source: str, weights: bool) -> Path:
    """The local folder of hf:ORG/NAME[@REVISION] in the Hugging Face cache: config.json only, or the weights and
    tokenizer too (`weights`), fetched where they are not cached and HF_HUB_OFFLINE is not set."""
    repo, _, revision = source.removeprefix(HUB).partition("@")
    if repo.count("/") > 1 or not repo.strip("/"):
        raise ModelFileError(f"{source}: a Hub model is named hf:ORG/NAME or hf:ORG/NAME@REVISION")
    try:
        import huggingface_hub as hub
    except ImportError:
        raise ModelFileError(f"{source}: a Hub model needs huggingface_hub: {FINETUNE_EXTRA}") from None
    try:
        if weights:
            return Path(hub.snapshot_download(repo, revision=revision or None,
                                              allow_patterns=["*.json", "*.safetensors", "*.bin", "*.model", "*.txt"]))
        return Path(hub.hf_hub_download(repo, "config.json", revision=revision or None)).parent
    except Exception as e:
        name = type(e).__name__
        if "LocalEntryNotFound" in name or "OfflineModeIsEnabled" in name:
            raise ModelFileError(f"{source}: not in the Hugging Face cache and the Hub cannot be reached (no network "
                                 "or HF_HUB_OFFLINE=1): download it once, or give its local folder") from None
        raise ModelFileError(f"{source}: {name}: {first_line(e, '(no message)')}") from None


@dataclass
class HFModel:
    """A Hugging Face model's hooks, as a model file would have them."""
    config: Any
    task: str
    folder: Path | None  # where its weights may be (None: a config.json alone)
    dtype: str | None = None  # None: torch's default dtype (float32, or bf16 while a bf16-true plan builds)
    padding: bool = False
    load_weights: bool = False  # training: the folder's weights (probe and estimate build it from the config)
    DEFAULTS: dict = field(default_factory=dict)
    MAX_CONTEXT: int | None = None
    name: str = ""  # the folder or Hub id, for the config's name_or_path (a saved adapter names its base by it)
    data_sha256: str | None = None  # train --data: the packed tokens' (text_data.with_data sets the data hooks)

    def __post_init__(self):
        self.MAX_CONTEXT = getattr(self.config, "max_position_embeddings", None)
        context = 512 if self.MAX_CONTEXT is None else min(512, self.MAX_CONTEXT)
        self.DEFAULTS = {"batch": 8, "context": context}
        if self.task == "sequence-classification" and getattr(self.config, "pad_token_id", None) is None:
            self.config.pad_token_id = 0  # (a decoder's classifier reads the last token before the padding)
        if self.task == "seq2seq" and getattr(self.config, "decoder_start_token_id", None) is None:
            self.config.decoder_start_token_id = getattr(self.config, "pad_token_id", None) or 0  # (T5's is 0)

    @property
    def weights(self) -> bool:
        return self.folder is not None and any((self.folder / name).is_file() for name in WEIGHT_FILES)

    def build_model(self):
        transformers = _transformers("transformers")
        auto = {"causal-lm": transformers.AutoModelForCausalLM,
                "sequence-classification": transformers.AutoModelForSequenceClassification,
                "seq2seq": transformers.AutoModelForSeq2SeqLM}[self.task]
        torch.manual_seed(0)  # the same model on every build (a resumed run rebuilds it)
        version = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
        # --dtype's, else torch's default (float32; bfloat16 while a bf16-true plan builds), not config.json's
        wanted = torch.get_default_dtype() if self.dtype is None else getattr(torch, self.dtype)
        dtype = {"dtype" if version >= (4, 56) else "torch_dtype": wanted}  # (its name before 4.56)
        if self.load_weights and self.weights:
            if getattr(self.config, "quantization_config", None):  # (bitsandbytes' 4-bit: levers/nf4_bnb.py)
                raise ModelFileError(f"{self.name or self.folder}: its weights are saved quantized (config.json's "
                                     "quantization_config): training from them is not supported yet; estimate and "
                                     "probe build it from its config, and train needs its unquantized weights")
            return auto.from_pretrained(str(self.folder), config=copy.deepcopy(self.config), **dtype)
        model = auto.from_config(copy.deepcopy(self.config), **dtype)
        model.config.name_or_path = self.name
        return model

    def make_batch(self, batch_size: int, context_length: int, device):
        """Token ids of the whole vocabulary at full length (packed: no attention mask) and the labels the task
        trains on. With `padding` an attention mask pads every other sequence over its last quarter (-100 in a
        language model's labels there)."""
        vocab = self.config.vocab_size
        ids = torch.randint(0, vocab, (batch_size, context_length), device=device)
        batch = {"input_ids": ids}
        if self.padding:
            mask = torch.ones_like(ids)
            mask[1::2, context_length - context_length // 4:] = 0
            batch["input_ids"] = ids = ids.masked_fill(mask == 0, getattr(self.config, "pad_token_id", None) or 0)
            batch["attention_mask"] = mask
        if self.task == "sequence-classification":
            batch["labels"] = torch.randint(0, self.config.num_labels, (batch_size,), device=device)
        elif self.task == "seq2seq":
            batch["labels"] = torch.randint(0, vocab, (batch_size, context_length), device=device)
        else:
            batch["labels"] = ids if not self.padding else ids.masked_fill(batch["attention_mask"] == 0, -100)
        return batch
