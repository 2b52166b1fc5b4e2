"""Chunked cross-entropy: a causal language model's loss computed over CHUNKS slices of the sequence, each slice's
logits made by the output layer alone and upcast to fp32 alone, as torchtune's chunked output and its
CEWithChunkedOutputLoss do (8 chunks). Hugging Face's own loss makes the whole (batch, sequence, vocabulary) logits,
upcasts them to fp32 at once, and its backward makes the fp32 gradient of all of them at once: with a large
vocabulary (Llama 3: 128,256) those are the step's largest tensors. Chunked, the whole logits never exist: the
model's forward runs with its output layer passed through (it returns the last hidden states), and the output layer
runs on each slice of them; only one slice's fp32 copy and fp32 gradient exist at a time (the log-probabilities
saved for backward are the same). Where the forward changes the logits after its output layer (Gemma 2's
soft-capping, Cohere's logit scale: `sliced_head` says), the whole logits are made and sliced instead. Under
activation offloading what the per-slice output layer and each slice's cross-entropy save stays on the device, as
torchtune's offloading leaves its output layer and loss (`forward_saves`); where the whole logits are made, the
output layer runs in the model's forward, and what it saves is offloaded with the rest.

It applies where oomtune computes the loss itself: a Hugging Face causal LM (PEFT LoRA-wrapped too) with the
default loss, whose forward computes transformers' shifted cross-entropy (ForCausalLMLoss), and `labels` in its
batch; the loss is then computed from the model's logits here (labels shifted as transformers shifts them, -100
ignored, the mean over the tokens counted), the same value within float rounding. A model file with its own
loss(), or a model whose loss is another (causal_lm_loss says which), gets no such rung (past.py says why)."""

from __future__ import annotations

import contextlib
import inspect
import re
import sys

import torch
import torch.nn.functional as F
from torch import nn

from ..dist.wrap import unwrapped
from ..errors import BAD_INPUT, OomtuneError
from ..model_file import ModelFileError

CHUNKS = 8  # torchtune's default
IGNORE = -100  # transformers' and torch's ignore_index


def causal_lm_loss(model: nn.Module) -> str | None:
    """None where the model's loss is transformers' shifted next-token cross-entropy (ForCausalLMLoss: Llama, GPT-2,
    Mistral, Qwen, ... and PEFT LoRA over them), the loss chunked_loss computes; else why not: a causal LM whose
    forward computes another loss (BART's decoder: unshifted labels), adds a router's auxiliary loss (a mixture of
    experts with output_router_logits), or a PEFT prompt-learning adapter (virtual tokens lengthen the logits)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    transformers = sys.modules.get("transformers")  # (a model of it imported it already)
    if transformers is None or not isinstance(base, transformers.PreTrainedModel):
        return "it is not a Hugging Face model"
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, dict) and any(getattr(c, "is_prompt_learning", False) for c in peft_config.values()):
        return "its PEFT adapter is prompt learning (virtual tokens lengthen the logits)"
    if getattr(getattr(base, "config", None), "output_router_logits", False):
        return "its loss adds the router's auxiliary loss (output_router_logits)"
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING

        source = inspect.getsource(type(base).forward)
    except (ImportError, OSError, TypeError):
        return "its forward's source cannot be read"
    loss_type = getattr(base, "loss_type", None)  # (as transformers' loss_function resolves it, without its warning)
    own = vars(base).get("_loss_function")  # (compiled: plan.compile; inspect.unwrap gives what was)
    loss = inspect.unwrap(own) if own is not None else LOSS_MAPPING[loss_type if loss_type in LOSS_MAPPING
                                                                    else "ForCausalLM"]
    if "self.loss_function(" not in source or loss is not LOSS_MAPPING.get("ForCausalLM"):
        return "its loss is not transformers' shifted cross-entropy (ForCausalLMLoss)"
    return None


_HEAD_LINE = re.compile(r"^\s*logits\s*=\s*self\.(\w+)\(hidden_states(\[[^\]]*\])?\)\s*$")
_LOGITS_SET = re.compile(r"^\s*(logits\s*[-+*/]?=(?!=)(?!.*,\s*$)|logits\.\w+_\()", re.MULTILINE)  # (not a keyword)
_PASSED_ON = re.compile(r"logits=logits|loss_function\(logits,|= \(logits,\)")  # the logits handed on as they are
_LOGITS = re.compile(r"\blogits\b")


def sliced_head(model: nn.Module) -> tuple[nn.Module, str] | None:
    """(the Hugging Face model, its output layer's attribute) where its forward's logits are its output layer's
    output and nothing else (`logits = self.lm_head(hidden_states)`, set once, and after it only handed on as they
    are, to the loss function and the output): then the output layer can run on each slice of the hidden states
    alone. None where the forward does anything else with them (soft-capping, a scale, Chameleon's masking of the
    image tokens: `logits[:, :, ids] = ...`), where the model's forward is its own (an instance attribute), and under
    FSDP (the output layer is the root unit's, gathered for the forward: not called outside it)."""
    outer = unwrapped(model)  # (DDP: its module, the model; the forward still runs through DDP)
    base = outer.get_base_model() if callable(getattr(outer, "get_base_model", None)) else outer
    if "forward" in vars(base) or any(c.__name__ == "FSDPModule" for m in (outer, base) for c in type(m).__mro__):
        return None
    try:
        lines = inspect.getsource(type(base).forward).splitlines()
    except (OSError, TypeError):
        return None
    at = [i for i, line in enumerate(lines) if _HEAD_LINE.match(line)]
    if len(at) != 1 or len(_LOGITS_SET.findall("\n".join(lines))) != 1:
        return None
    if any(_LOGITS.search(_PASSED_ON.sub("", line)) for line in lines[at[0] + 1:]):
        return None
    name = _HEAD_LINE.match(lines[at[0]]).group(1)
    head = getattr(base, name, None)
    if not isinstance(head, nn.Module) or head is not base.get_output_embeddings():
        return None
    return base, name


@contextlib.contextmanager
def _passed_through(base: nn.Module, name: str):
    """The model's output layer replaced by nn.Identity for one forward (no hook of the layer's runs on the hidden
    states); put back after, whatever happens."""
    head = getattr(base, name)
    setattr(base, name, nn.Identity())
    try:
        yield head
    finally:
        setattr(base, name, head)


def why_not(label: str, has_own_loss: bool, not_causal: str | None) -> str | None:
    """Why the chunked-loss rung cannot apply to this model (`not_causal`: causal_lm_loss's answer), or None."""
    if has_own_loss:
        return (f"{label} has its own loss(): chunking it is the loss's to do (torchtune's CEWithChunkedOutputLoss "
                "is one way)")
    if not_causal is not None:
        return (f"{label} is not a Hugging Face causal LM with transformers' own loss ({not_causal}): chunked "
                "cross-entropy computes that loss from the model's logits")
    return None


def check_applies(model_file, model: nn.Module) -> None:
    """One line, exit 2, for a plan with chunked_loss on a model it cannot compute the loss of (a config edited by
    hand, or --levers chunked-loss): never a silent replacement of the model file's own loss."""
    why = why_not(model_file.label, model_file.has("loss"), causal_lm_loss(model))
    if why is not None:
        raise OomtuneError(f"plan.chunked_loss: {why} (remove the key)", BAD_INPUT)


def chunk_cross_entropy(part: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """One slice's cross-entropy, its logits upcast to fp32 alone, summed over the tokens counted. Each is copied
    whole (contiguous) at every micro-batch, 1 included: a slice of a batch of one is contiguous already and would
    be flattened in place, where a larger batch's is copied, and the two traces would not line up (replay.py)."""
    upcast = _copied(part) if part.dtype == torch.float32 else part.float()
    return F.cross_entropy(upcast.flatten(0, 1), _copied(target).flatten(), ignore_index=IGNORE, reduction="sum")


def _copied(x: torch.Tensor) -> torch.Tensor:
    return x.clone(memory_format=torch.contiguous_format)


def chunked_loss(model_file, model: nn.Module, batch, chunk_loss=chunk_cross_entropy,
                 forward_saves=contextlib.nullcontext) -> torch.Tensor:
    """The causal LM's mean next-token cross-entropy over `batch` (a dict with `labels`), in CHUNKS slices, each
    by `chunk_loss` (chunk_cross_entropy, or it compiled: plan.compile). `forward_saves()`: the context the model's
    forward runs in, the slices' output layer and loss outside it (activation offloading: what they save stays on
    the device, as torchtune's offloading leaves its output layer and loss)."""
    if not isinstance(batch, dict) or "labels" not in batch:
        raise ModelFileError(f"{model_file.label}: plan.chunked_loss computes a causal LM's loss from the batch's "
                             "'labels', and make_batch's batch has none (add them, or remove the key)")
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    sliced = sliced_head(model)
    with model_file.user_code("the model's forward (plan.chunked_loss: without its labels)"):
        if sliced is None:
            with forward_saves():
                parts, head = model(**inputs).logits, None
        else:
            with _passed_through(*sliced) as head, forward_saves():
                parts = model(**inputs).logits  # (the last hidden states)
        labels = F.pad(batch["labels"], (0, 1), value=IGNORE)[:, 1:]  # token t predicts t + 1, as transformers shifts
        total = None
        for part, target in zip(parts.chunk(CHUNKS, dim=1), labels.chunk(CHUNKS, dim=1), strict=True):
            loss = chunk_loss(part if head is None else head(_copied(part)), target)  # (copied: as above)
            total = loss if total is None else total + loss
        return total / (labels != IGNORE).sum()
