"""The plan and the config file's schema: frozen dataclasses that check their own values.

Defaults live here and only here (the searches' too: HEADROOM, TRIAL_STEPS). Loading them from YAML is
loading.py's job, writing them writing.py's."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..errors import MAX_COUNT, ConfigError, shown

PRECISIONS = ("fp32", "bf16", "fp16", "bf16-true")


# bf16 and fp16 are mixed (autocast over fp32 weights); bf16-true (Lightning's name) holds the weights, gradients
# and optimizer state in bf16 themselves
Precision = Literal["fp32", "bf16", "fp16", "bf16-true"]


SHARDINGS = ("none", "ddp", "fsdp")


Sharding = Literal["none", "ddp", "fsdp"]  # none: one process; ddp: replicated (DDP); fsdp: sharded (FSDP2)


HEADROOM = 0.1  # the searches' default: fraction of the budget kept free (fragmentation, longer batches)


TRIAL_STEPS = 2  # optimizer steps per trial: the optimizer state exists when the peak is read


LEVER_LABELS = {  # the plan keys past accumulation, as a plan's description names them
    "compile": "compiled",
    "chunked_loss": "chunked cross-entropy",
    "optimizer_in_backward": "optimizer stepped in backward",
    "optimizer_8bit": "8-bit AdamW state",
    "nf4_frozen_weights": "NF4 frozen weights",
    "offload_optimizer": "optimizer offloaded to host",
    "offload_activations": "activations offloaded to host",
}


@dataclass(frozen=True)
class Plan:
    """What one optimizer step looks like, on each of world_size ranks (processes, one per GPU).
    global_batch_size = micro_batch_size x grad_accum_steps x world_size."""

    micro_batch_size: int  # per rank
    context_length: int
    precision: Precision = "fp32"
    activation_checkpointing: bool = False
    grad_accum_steps: int = 1
    world_size: int = 1  # ranks the plan was made for (1 in configs older than multi-GPU)
    sharding: Sharding = "none"
    optimizer_8bit: bool = False  # AdamW's two moments in 8 bits (a byte each plus a scale per block of 256)
    offload_optimizer: bool = False  # optimizer state and step in host memory; gradients moved there as made
    offload_activations: bool = False  # tensors saved for backward kept in host memory
    nf4_frozen_weights: bool = False  # frozen Linear weights (PEFT LoRA's base) stored as 4-bit NF4
    chunked_loss: bool = False  # a causal LM's cross-entropy in 8 slices of the sequence, each upcast to fp32 alone
    optimizer_in_backward: bool = False  # each parameter updated in backward as its gradient is made, which is freed
    compile: bool = False  # each block and the loss torch.compile'd (levers/compile.py)
    global_batch_size: int = 0  # 0 = derive it

    def __post_init__(self):
        for name in ("micro_batch_size", "context_length", "grad_accum_steps", "world_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"plan.{name} must be at least 1, got {getattr(self, name)}")
            if getattr(self, name) > MAX_COUNT:
                raise ConfigError(f"plan.{name} must be at most {MAX_COUNT:,}, got {shown(getattr(self, name))}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"plan.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.sharding != "none" and (self.optimizer_8bit or self.offload_optimizer or self.nf4_frozen_weights):
            raise ConfigError(f"plan.sharding is {self.sharding}: optimizer_8bit, offload_optimizer and "
                              "nf4_frozen_weights run on one process only")
        if self.precision == "fp16" and self.offload_optimizer:
            raise ConfigError("plan.precision is fp16: offload_optimizer cannot run with it (fp16's GradScaler "
                              "unscales the gradients on the device, which the offload has already moved off "
                              "it); use bf16, bf16-true or fp32")
        if self.optimizer_in_backward:
            self._check_in_backward()
        if self.sharding not in SHARDINGS:
            raise ConfigError(f"plan.sharding must be one of {', '.join(SHARDINGS)}, got {self.sharding!r}")
        if self.world_size > 1 and self.sharding == "none":
            raise ConfigError(f"plan.sharding is none but plan.world_size is {self.world_size}: ranks need ddp "
                              "(replicated) or fsdp (sharded)")
        expected = self.micro_batch_size * self.grad_accum_steps * self.world_size
        if self.global_batch_size == 0:
            object.__setattr__(self, "global_batch_size", expected)
        elif self.global_batch_size != expected:
            ranks = f" x {self.world_size}" if self.world_size > 1 else ""
            raise ConfigError(
                f"plan.global_batch_size is {self.global_batch_size} but micro_batch_size x grad_accum_steps"
                f"{' x world_size' if ranks else ''} = {self.micro_batch_size} x {self.grad_accum_steps}{ranks} "
                f"= {expected}"
            )

    def _check_in_backward(self) -> None:
        clash = [why for on, why in (
            (self.grad_accum_steps > 1, f"grad_accum_steps {self.grad_accum_steps} (every micro-batch's backward "
                                        "would update the weights)"),
            (self.world_size > 1, f"{self.world_size} ranks (their gradients are averaged after backward)"),
            (self.precision == "fp16", "precision fp16 (its GradScaler checks every gradient before the step)"),
            (self.offload_optimizer, "offload_optimizer (its hooks take the gradients to the host)")) if on]
        if clash:
            raise ConfigError(f"plan.optimizer_in_backward cannot run with {'; '.join(clash)}")

    def for_world_size(self, world_size: int) -> Plan | None:
        """The same global batch on `world_size` ranks: the accumulation rescaled, the micro-batch kept or cut to
        its largest divisor that shares out evenly (None when the global batch is not a multiple of the ranks).
        More than one rank replicate (ddp) a plan that had none; one rank drops ddp (a one-process DDP only adds its
        gradient buckets) and keeps fsdp."""
        fits = [d for d in range(self.micro_batch_size, 0, -1)
                if self.micro_batch_size % d == 0 and self.global_batch_size % (d * world_size) == 0]
        if not fits:
            return None
        sharding = ("ddp" if self.sharding == "none" and world_size > 1 else
                    "none" if self.sharding == "ddp" and world_size == 1 else self.sharding)
        return dataclasses.replace(self, micro_batch_size=fits[0],
                                   grad_accum_steps=self.global_batch_size // (fits[0] * world_size),
                                   world_size=world_size, sharding=sharding, global_batch_size=0)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.context_length

    def describe(self, with_global: bool = True) -> str:
        """One line; `with_global`: with the global batch (not for a trial's plan, whose accumulation is not the
        target's)."""
        parts = [f"micro-batch {self.micro_batch_size}", f"context {self.context_length}", self.precision]
        if self.activation_checkpointing:
            parts.append("checkpointing")
        if self.grad_accum_steps > 1:
            parts.append(f"x{self.grad_accum_steps} accumulation")
        if self.sharding != "none":
            parts.append(f"{self.sharding} x{self.world_size} rank{'s' if self.world_size > 1 else ''}")
        parts += [label for key, label in LEVER_LABELS.items() if getattr(self, key)]
        return ", ".join(parts) + (f" (global batch {self.global_batch_size})" if with_global else "")


@dataclass(frozen=True)
class TrainConfig:
    """The section a person edits by hand. Names follow torchtune where it has one."""

    steps: int = 1000
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 100
    weight_decay: float = 0.1
    clip_grad_norm: float | None = 1.0
    eval_interval: int = 100
    eval_steps: int = 20
    checkpoint_interval: int = 200
    log_every_n_steps: int = 10
    run_dir: str = "runs/oomtune"
    seed: int = 1337
    save_adapter: bool = False  # also at every checkpoint, not only at the end: the adapter / the HF model folder
    data: str | None = None  # a JSONL / text file a Hugging Face model's tokenizer packs (None: the model's hooks)

    def __post_init__(self):
        for name in ("steps", "eval_interval", "eval_steps", "checkpoint_interval", "log_every_n_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be at least 1, got {getattr(self, name)}")
            if getattr(self, name) > MAX_COUNT:
                raise ConfigError(f"train.{name} must be at most {MAX_COUNT:,}, got {shown(getattr(self, name))}")
        if self.warmup_steps < 0:
            raise ConfigError(f"train.warmup_steps must be 0 or more, got {self.warmup_steps}")
        if self.warmup_steps > MAX_COUNT:
            raise ConfigError(f"train.warmup_steps must be at most {MAX_COUNT:,}, got {shown(self.warmup_steps)}")
        for name in ("lr", "min_lr", "weight_decay", "clip_grad_norm"):
            if getattr(self, name) is not None and not math.isfinite(getattr(self, name)):  # .nan / .inf in YAML
                raise ConfigError(f"train.{name} must be a finite number, got {getattr(self, name)}")
        if self.lr <= 0 or self.min_lr < 0:
            raise ConfigError("train.lr must be > 0 and train.min_lr >= 0")
        if self.min_lr > self.lr:  # the cosine would climb from lr to min_lr
            raise ConfigError(f"train.min_lr ({self.min_lr}) must not be above train.lr ({self.lr})")
        if self.weight_decay < 0:  # AdamW would push every weight away from 0
            raise ConfigError(f"train.weight_decay must be 0 or more, got {self.weight_decay}")
        if self.clip_grad_norm is not None and self.clip_grad_norm <= 0:  # < 0 flips the gradient, 0 zeroes it
            raise ConfigError(f"train.clip_grad_norm must be > 0, or null for no clipping, got {self.clip_grad_norm}")
        if not str(self.run_dir).strip():
            raise ConfigError("train.run_dir must not be empty")
        if self.data is not None and (not self.data.strip() or "\0" in self.data):
            raise ConfigError(f"train.data must name a file, got {shown(self.data)}")
        if "\0" in str(self.run_dir):  # (no file system takes one: open() raised a bare ValueError)
            raise ConfigError(f"train.run_dir must not hold a NUL byte, got {shown(self.run_dir)}")
        if not 0 <= self.seed < 2**63:  # (torch's generators take 64 bits; the ranks add their rank to it)
            raise ConfigError(f"train.seed must be from 0 to 2**63 - 1, got {self.seed}")


@dataclass(frozen=True)
class TrialRecord:
    """One trial as the config file and --json report it."""

    rung: str
    stage: str  # target | context | batch | verify
    micro_batch_size: int
    context_length: int
    grad_accum_steps: int
    precision: Precision
    activation_checkpointing: bool
    result: Literal["fits", "oom", "over-headroom"]
    peak_bytes: int | None = None  # the largest over the ranks
    tokens_per_s: float | None = None
    seconds: float = 0.0  # the whole trial
    world_size: int = 1
    sharding: Sharding = "none"
    host_peak_bytes: int | None = None  # host memory the plan's offloaded parts held at most (offload rungs)
    build_seconds: float = 0.0  # of `seconds`: building the model, its wrappers and its optimizer
    source: Literal["run", "first-step-run", "replayed", "extrapolated", "bounded"] = "run"  # run: the steps ran;
    # first-step-run: the first ran, the second was made from it (memory/second_step.py); replayed: its peaks were
    # predicted from two runs of the same plan at other micro-batches (memory/replay.py), or from four at other
    # contexts (memory/context_curves.py), no step ran; extrapolated: from runs of the model with 2, 3 and 4 of its
    # repeated blocks (memory/repeats.py), the whole model never ran; bounded: out of memory, not run, since
    # micro-batch 1 of the same plan is (the estimate of a model made from fewer blocks)


@dataclass(frozen=True)
class MemoryBreakdown:
    """What a plan's peak is made of, in bytes (512-byte rounded, as the CUDA allocator rounds). The six
    parts are what was live at the peak and sum to tensor_peak_bytes exactly; margin_bytes (what a GPU
    needs beyond tensors: CUDA context, workspaces, allocator rounding) comes on top, so
    peak_bytes = tensor_peak_bytes + margin_bytes."""

    phase: str  # setup | forward | backward | optimizer: the phase of the step the peak fell in
    parameters_bytes: int  # weights and buffers
    gradients_bytes: int
    optimizer_state_bytes: int
    autocast_copies_bytes: int  # low-precision copies of the weights that autocast makes and caches
    activations_bytes: int  # kept by the forward for the backward (recomputed ones under checkpointing)
    temporaries_bytes: int  # the rest: op outputs in flight, activation gradients, the batch, optimizer scratch
    tensor_peak_bytes: int
    margin: str = "0"  # the margin rule, e.g. 512MiB+5% (see `oomtune estimate --help`)
    margin_bytes: int = 0
    peak_bytes: int = 0  # 0 = derive it
    host_bytes: int = 0  # apart from all of the above: host memory the offload levers held at most
    # the CUDA caching allocator model's reserved peak over the same run (memory/allocator.py), cuBLAS workspaces
    # included where a card profile seeded them; with a card's margin peak_bytes is context + this
    modelled_reserved_bytes: int | None = None
    context_bytes: int = 0  # of margin_bytes: the card's CUDA context (card margins only)
    workspace_bytes: int = 0  # of margin_bytes: its cuBLAS workspaces; the rest of it is the caching allocator's
    # the tensor peak of the step's phases alone (forward, backward, optimizer; the model's build left out): what a
    # run reads that resets its peak once the model is built (torchtune's get_memory_stats); None: not measured
    step_peak_bytes: int | None = None

    PARTS = ("parameters", "gradients", "optimizer_state", "autocast_copies", "activations", "temporaries")

    def part_bytes(self) -> dict[str, int]:
        return {name: getattr(self, f"{name}_bytes") for name in self.PARTS}

    def __post_init__(self):
        total = sum(self.part_bytes().values())
        if total != self.tensor_peak_bytes:
            raise ConfigError(f"breakdown: the parts sum to {total}, not tensor_peak_bytes {self.tensor_peak_bytes}")
        expected = self.tensor_peak_bytes + self.margin_bytes
        if self.peak_bytes == 0:
            object.__setattr__(self, "peak_bytes", expected)
        elif self.peak_bytes != expected:
            raise ConfigError(f"breakdown.peak_bytes is {self.peak_bytes} but tensor_peak_bytes + margin_bytes "
                              f"= {expected}")


@dataclass(frozen=True)
class FoundBy:
    """How the plan was found: enough to tell whether it still applies."""

    command: str  # probe | estimate
    estimated: bool  # true when no real memory was measured (the fake device)
    device: str
    gpu_name: str
    budget_bytes: int
    headroom: float
    objective: Literal["fit", "throughput"]
    target_batch: int
    target_context: int
    min_context: int
    peak_bytes: int
    tokens_per_s: float | None
    torch_version: str
    cuda_version: str | None
    oomtune_version: str
    date: str
    breakdown: MemoryBreakdown | None = None  # what the peak is made of (estimate, check); absent in older files
    trials: tuple[TrialRecord, ...] = ()
    notes: tuple[str, ...] = ()  # how it was measured, where that is not what one would assume (eager, computed)
    host_peak_bytes: int | None = None  # host memory the plan's offloaded parts need (offload levers only)
    card: str | None = None  # the card profile (--gpu) a simulated device accounted by; None: CPU semantics, or cuda
    prior: str | None = None  # probe: how its trials were chosen from the estimate (None: searched, no prior asked)
    margin: str | None = None  # probe: the flat margin a simulated device with a card (or fake) accounted by
    checkpointing_via: Literal["switch", "blocks"] | None = None  # a checkpointed plan: the model's own switch
    # (Hugging Face's gradient_checkpointing_enable) or blocks oomtune wrapped (a blocks() hook, a ModuleList)
    threads: int | None = None  # probe on the cpu device: torch's threads its tokens/s were measured with

    def __post_init__(self):
        if self.budget_bytes <= 0:  # `check` re-measures against it
            raise ConfigError(f"found_by.budget_bytes must be more than 0, got {self.budget_bytes}")
        if self.peak_bytes < 0:  # `check` compares the new peak with it
            raise ConfigError(f"found_by.peak_bytes must be 0 or more, got {self.peak_bytes}")


TASKS = ("causal-lm", "sequence-classification", "seq2seq")  # what a Hugging Face model is trained to do
PEFT_TASKS = {"causal-lm": "CAUSAL_LM", "sequence-classification": "SEQ_CLS", "seq2seq": "SEQ_2_SEQ_LM"}  # PEFT's
MODEL_DTYPES = ("float32", "bfloat16", "float16")  # what a Hugging Face model's weights are built or loaded in
HUB = "hf:"  # a model source on the Hugging Face Hub: hf:ORG/NAME[@REVISION]


@dataclass(frozen=True)
class LoraSection:
    """PEFT LoRA adapters put on the model after it is built (the base frozen, the adapters trained)."""
    r: int
    alpha: float | None = None  # None: 2 x r
    dropout: float = 0.0
    targets: tuple[str, ...] = ()  # module names; (): PEFT's defaults for the architecture

    def __post_init__(self):
        if self.r < 1 or self.r > MAX_COUNT:
            raise ConfigError(f"model.lora.r must be a positive whole number, got {shown(self.r)}")
        if self.alpha is not None and not (0 < self.alpha < math.inf):
            raise ConfigError(f"model.lora.alpha must be more than 0, got {shown(self.alpha)}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"model.lora.dropout must be at least 0 and under 1, got {shown(self.dropout)}")
        if any(not t or "," in t for t in self.targets):
            raise ConfigError(f"model.lora.targets must be module names, got {list(self.targets)}")


@dataclass(frozen=True)
class ModelSection:
    """Everything that shapes the model: where it comes from and the arguments it was built with."""
    source: str  # a model file, a Hugging Face folder or its config.json (relative to the config's folder unless
    # absolute), or hf:ORG/NAME[@REVISION]
    sha256: str | None = None  # of the model file / config.json when written: train and export refuse a changed one
    task: Literal["causal-lm", "sequence-classification", "seq2seq"] | None = None  # Hugging Face models
    dtype: Literal["float32", "bfloat16", "float16"] | None = None  # Hugging Face models (None: float32, bf16 in a
    # bf16-true plan; never config.json's torch_dtype)
    padding: bool = False  # Hugging Face models: batches carry an attention mask with padding
    lora: LoraSection | None = None
    args: dict[str, int | bool | str | float] = field(default_factory=dict)  # a model file's ARGS, as built

    def __post_init__(self):
        if not self.source or "\0" in self.source:
            raise ConfigError(f"model.source must name a model file, a Hugging Face folder or hf:ORG/NAME, got "
                              f"{shown(self.source)}")
        if self.task is not None and self.task not in TASKS:
            raise ConfigError(f"model.task must be one of {', '.join(TASKS)}, got {shown(self.task)}")
        if self.dtype is not None and self.dtype not in MODEL_DTYPES:
            raise ConfigError(f"model.dtype must be one of {', '.join(MODEL_DTYPES)}, got {shown(self.dtype)}")
        if self.sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ConfigError(f"model.sha256 must be 64 hex digits, got {shown(self.sha256)}")
        for key in self.args:
            if not (isinstance(key, str) and key.isidentifier()):
                raise ConfigError(f"model.args: {shown(key)} is not an argument name")

    @property
    def on_hub(self) -> bool:
        return self.source.startswith(HUB)

    def path(self, config_path: str | Path | None) -> Path:
        """The model's file or folder, where a relative one is taken from the config's folder (None: as given)."""
        p = Path(self.source)
        return p if p.is_absolute() or config_path is None else (Path(config_path).resolve().parent / p)


@dataclass(frozen=True)
class Config:
    model: ModelSection  # a plain string in a file is read as {source: that string}
    plan: Plan
    train: TrainConfig = field(default_factory=TrainConfig)
    found_by: FoundBy | None = None

    def __post_init__(self):
        if isinstance(self.model, (str, Path)):
            object.__setattr__(self, "model", ModelSection(source=str(self.model)))

    def model_path(self, config_path: str | Path) -> Path:
        return self.model.path(config_path)

