"""What `oomtune train` says before its first step about settings that would surprise: a warmup as long as the run,
and a plan made for a GPU trained on the simulated cpu device because there is none here. Library code: it returns
the notes; the trainer reports them as events and the CLI prints them."""

from __future__ import annotations

import math

import torch

from .. import rank_allocation as adalora
from ..config.schema import FoundBy
from ..errors import OomtuneError
from ..hook_names import hook_name_notes
from ..levers.nf4_bnb import declared_note
from ..memory.cards import find_gpu
from ..memory.devices import Device, TrackedDevice
from ..model_file import ModelFile, is_compiled, own_compile_note
from ..models.hf import HFModel
from ..search.weights_dtype import precision_note
from ..step import Training
from ..units import format_bytes
from .events import Note
from .inputs import Inputs


def run_notes(inputs: Inputs, start_step: int, requested: str | None, device: Device) -> list[Note]:
    """The notes for a run of `inputs` from `start_step` on `device`, asked for as `requested` (--device, or None):
    the device's, the warmup's, then those of the resume. Called before the build: it forgets the compiled calls
    that ran eager earlier in the process (a search's), so that the run tells its own (compile_fallback_notes)."""
    from ..memory.compiled import compile_notes

    compile_notes()
    found, cfg, notes = inputs.file_config.found_by, inputs.cfg, []
    if _trains_for_a_gpu_without_one(found, requested, device):
        notes.append(Note(_no_gpu_note(found, device), warning=True))
    if cfg.warmup_steps >= cfg.steps > start_step:
        notes.append(Note(f"warmup ({cfg.warmup_steps} steps) is as long as the run ({cfg.steps} steps): the "
                          f"learning rate never reaches {cfg.lr:g}; pass --warmup-steps (fewer than {cfg.steps})",
                          warning=True))
    notes += [Note(n, warning=True) for n in hook_name_notes(inputs.model_file.label, inputs.model_file.module)]
    planned = inputs.file_config.plan
    if inputs.resume_state is None and planned.world_size != inputs.plan.world_size:  # (a resume says its own)
        notes.append(Note(f"the plan was found for {planned.world_size} rank(s) ({planned.describe()}); on "
                          f"{inputs.plan.world_size} it runs as {inputs.plan.describe()}, a shape no trial measured: "
                          f"probe it on {inputs.plan.world_size} (--nproc-per-node) to know it fits", warning=True))
    return notes + [Note(n) for n in inputs.resume_notes]


def built_notes(t: Training, inputs: Inputs) -> list[Note]:
    """What the built model and optimizer show: AdaLoRA's schedule against the run's steps, trained weights built in
    16 bits under a plan whose precision says otherwise, and the decay the model
    file's optimizer() gave its groups where the config's train.weight_decay replaces it (not a --weight-decay given
    now: that is the user's word)."""
    cfg, label = inputs.cfg, inputs.model_file.label
    notes = [Note(n, warning=True) for n in adalora.notes(t.rank_allocator, cfg.steps)]
    notes += [Note(n, warning=True) for n in _built_in_16_bits(t, label)]
    theirs = sorted({d for d in t.decaying if d and not math.isclose(d, cfg.weight_decay)})
    if inputs.model_file.has("optimizer") and theirs and cfg.weight_decay == inputs.file_config.train.weight_decay:
        notes.append(Note(f"{label}'s optimizer() builds its decaying param groups with weight_decay "
                          f"{', '.join(f'{d:g}' for d in theirs)}; train.weight_decay {cfg.weight_decay:g} replaces "
                          f"it (pass --weight-decay {theirs[0]:g}, or set train.weight_decay, to keep it)",
                          warning=True))
    return notes


def data_notes(t: Training, model_file: ModelFile, device: Device) -> list[Note]:
    """Warnings about what the run trains on: a compiled model on a simulated device (traced as --compile),
    synthetic data (no train_batches), no evaluation (no eval_batches)."""
    label, notes = model_file.label, []
    hooks = model_file.module
    if isinstance(hooks, HFModel) and hooks.load_weights and not hooks.weights:  # (a folder, or a config.json)
        notes.append(Note(f"{label} has no weights (model.safetensors, pytorch_model.bin): training starts from "
                          "random ones, built from its config.json", warning=True))
    if isinstance(device, TrackedDevice) and is_compiled(t.module):
        notes.append(Note(own_compile_note(label, device.kind, training=True), warning=True))
    notes += [Note(text) for text in declared_note(model_file)]  # its BitsAndBytesConfig's 4-bit weights
    if not model_file.has("train_batches"):
        notes.append(Note(f"{label} has no train_batches(): training on make_batch(), random synthetic data (the loss "
                          "shows the loop runs, not that the model learns)", warning=True))
    if not model_file.has("eval_batches"):
        notes.append(Note(f"{label} has no eval_batches(): no evaluation", warning=True))
    return notes


def compile_fallback_notes(step: int) -> list[Note]:
    """plan.compile on the simulated devices: the compiled calls that could not be traced (so they run eager, and
    the memory is eager's) since the last step; each is traced at its first call, in the first steps."""
    from ..memory.compiled import compile_notes

    return [Note(f"{note} (step {step}): it trains eager", warning=True) for note in compile_notes()]


def _built_in_16_bits(t: Training, label: str) -> list[str]:
    """A plan whose precision says fp32 weights (fp32, or autocast's bf16 / fp16) for a model whose build_model()
    returns every trained weight in 16 bits (a config written before the probe labelled such a plan bf16-true, or
    by hand): what it trains is those weights, their gradients and AdamW state in 16 bits."""
    dtypes = {p.dtype for p in t.module.parameters() if p.requires_grad and p.is_floating_point()}
    dtype = str(next(iter(dtypes))).removeprefix("torch.") if dtypes in ({torch.bfloat16}, {torch.float16}) else None
    note = precision_note(label, t.plan.precision, dtype, "set plan.precision: bf16-true")
    return [note] if note else []


def _trains_for_a_gpu_without_one(found: FoundBy | None, requested: str | None, device: Device) -> bool:
    """The plan was found for a GPU (on one, or on a simulated device standing in for one), and it trains on the
    simulated cpu device because `auto` found no GPU here (not because the config or --device asked for cpu)."""
    if found is None or device.kind != "cpu" or torch.cuda.is_available():
        return False
    for_a_gpu = found.device in ("cuda", "fake") or found.card is not None
    by_auto = requested == "auto" or (requested is None and found.device not in ("cuda", "cpu"))
    return for_a_gpu and by_auto


def _no_gpu_note(found: FoundBy, device: Device) -> str:
    gpu = found.gpu_name.removesuffix(" (estimated)")
    if found.card:
        try:
            gpu = find_gpu(found.card).name
        except OomtuneError:  # a card this version's table lacks: the name the config recorded
            pass
    budget = format_bytes(found.budget_bytes)
    if found.device == "cuda":
        how = f"probed on {gpu} (cuda, budget {budget})"
    else:
        gpu = gpu if gpu.startswith(("a ", "an ", "fake")) else f"{'an' if gpu[:1] in 'AEIOUaeiou8' else 'a'} {gpu}"
        how = f"{'estimated' if found.estimated else 'probed'} for {gpu} ({found.device} device, budget {budget})"
    line = f"this plan was {how}; no GPU here, so it trains on the cpu device"
    if device.budget_bytes == found.budget_bytes:
        return line + ", simulating that budget" + (" and card" if device.card is not None else "")
    return (line + f" in a simulated budget of {format_bytes(device.budget_bytes)}, not the plan's (--budget "
            f"{budget.replace(' ', '')} simulates it)")
