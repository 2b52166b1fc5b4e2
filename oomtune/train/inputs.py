"""What `oomtune train` was asked to do, checked before anything is written: the config and its overrides, the
model file, the run dir, the checkpoint to resume from and its plan on this run's number of ranks, and the device
to train on. Everything that can be bad input fails here (the launcher checks it once before starting the ranks).

Data on several ranks: every rank draws the same global stream (same seed) and keeps its share of each global
batch - rank r the r-th of world_size equal slices. What a step trains on therefore does not depend on the
number of ranks, and a checkpoint of N ranks resumed on M replays the same stream to the same position.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config.loading import from_dict, load_config
from ..config.schema import Config, Plan, TrainConfig
from ..dist.launch import worker_rank
from ..errors import BAD_INPUT, ConfigError, ModelFileError, OomtuneError, first_line
from ..memory.cards import find_gpu
from ..memory.devices import Device, make_device, resolve_kind
from ..model_file import ModelFile
from ..models.source import open_model
from ..models.text_data import with_data
from ..search.check import check_floor, check_margin
from ..units import format_bytes
from .checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, older_intact
from .pretrained import check_ours
from .rundir import METRICS, check_run_dir, in_use_message, no_checkpoint_message, run_dir_user


@dataclass
class Inputs:
    """What `oomtune train` was asked to do, checked: everything that can be bad input fails here, before a file
    is written (the launcher checks it once before starting the ranks)."""

    config_path: Path
    file_config: Config
    cfg: TrainConfig
    model_file: ModelFile
    run_dir: Path
    plan: Plan  # on this run's number of ranks
    data_batch: int  # the size batches are drawn at; each rank keeps its share, cut into micro-batches
    piece: int  # examples per piece of a rank's share (train_ranks.share_size)
    resume_state: dict | None = None
    resumed_from: Path | None = None
    resume_notes: tuple[str, ...] = ()  # said once training has started


def check_inputs(config_path: str | Path, overrides: dict[str, Any] | None, *, resume: bool,
                 world_size: int = 1) -> Inputs:
    config_path = Path(config_path)
    file_config = load_config(config_path)  # as on disk: what an OOM fallback rewrites
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    try:
        cfg = dataclasses.replace(file_config.train, **given)
    except ConfigError as e:  # the dataclass validates: defaults and rules live there only
        raise ConfigError(flags_named(e.message, given)) from None
    try:
        model_file = open_model(file_config.model, config_path=config_path, verify=True, load_weights=True)
    except ModelFileError as e:
        raise ModelFileError(f"{config_path}: {e.message}") from None
    run_dir = Path(cfg.run_dir)
    check_run_dir(run_dir)  # a file, an unwritable folder: bad input, before the model is built
    check_ours(run_dir)  # an adapter/ or model/ of the user's, which the end of the run would replace
    user = run_dir_user(run_dir) if worker_rank() in (None, 0) else None  # (rank 0 of these ranks may hold it now)
    if user is not None:
        raise OomtuneError(in_use_message(run_dir, user), BAD_INPUT)
    state, latest = None, None
    if resume:
        latest = latest_checkpoint(run_dir)
        if latest is None:
            raise OomtuneError(no_checkpoint_message(run_dir), BAD_INPUT)
        state, plan = load_latest(latest)
        check_same_run(latest, state, plan, file_config.plan, model_file)
        cfg, notes = _resumed_settings(cfg, file_config.train, state, given)
        smaller = file_config.plan
        if (smaller.micro_batch_size < plan.micro_batch_size and plan.micro_batch_size % smaller.micro_batch_size == 0
                and not plan.optimizer_in_backward  # (it cannot accumulate: no fallback wrote a smaller one)
                and (smaller.context_length, smaller.precision, smaller.activation_checkpointing, smaller.sharding,
                     smaller.global_batch_size) == (plan.context_length, plan.precision,
                                                    plan.activation_checkpointing, plan.sharding,
                                                    plan.global_batch_size)):
            # an out-of-memory fallback wrote a smaller micro-batch into the config after this checkpoint
            plan = dataclasses.replace(plan, micro_batch_size=smaller.micro_batch_size, global_batch_size=0,
                                       grad_accum_steps=plan.global_batch_size // (smaller.micro_batch_size
                                                                                   * plan.world_size))
    else:
        notes = ()
        if latest_checkpoint(run_dir) is not None:
            raise OomtuneError(f"run dir {run_dir} already holds a run ({latest_checkpoint(run_dir).name}): pass "
                               "--resume to continue it, or --run-dir for a new one", BAD_INPUT)
        if (run_dir / METRICS).exists():  # a run that stopped before its first checkpoint: nothing to resume
            raise OomtuneError(f"run dir {run_dir} holds a run that has no checkpoint to resume ({METRICS} only): "
                               f"delete {run_dir / METRICS} to start over there, or pass --run-dir for a new one",
                               BAD_INPUT)
        plan = file_config.plan
    where = str(latest or config_path)
    plan = plan_for_ranks(plan, world_size, where)
    if cfg.data is not None:  # (checked here: a bad file is one line before the run dir is touched)
        digest = with_data(model_file, cfg.data, plan.context_length)
        if state is not None and state["data"].get("sha256") not in (None, digest):
            raise OomtuneError(f"--data {cfg.data}: its tokens are not those {latest} was trained on (another file, "
                               "tokenizer or context): resume with the same data, or pass --run-dir for a new run",
                               BAD_INPUT)
    data_batch = state["data"]["batch_size"] if state else plan.micro_batch_size
    return Inputs(config_path, file_config, cfg, model_file, run_dir, plan, data_batch,
                  share_size(plan, data_batch, where), state, latest, notes)


def flags_named(message: str, given: dict[str, Any]) -> str:
    """A train: rule's message, each setting named as the user gave it: a flag given now as the flag (--min-lr),
    any other as the config file's key (train.min_lr), which is where its value came from."""
    for key in sorted(given, key=len, reverse=True):
        message = re.sub(rf"\btrain\.{key}\b", "--" + key.replace("_", "-"), message)
    return message


def check_same_run(latest: Path, state: dict, plan: Plan, in_file: Plan, model_file: ModelFile) -> None:
    """A checkpoint of another model file's run, with levers this config does not have (its plan is what a resume
    builds): say so, rather than blame the config for the checkpoint's plan (NF4 on a model with no weights for it).
    A renamed model file with the config's own plan resumes; a same-plan checkpoint of another model is caught
    where its weights are loaded."""
    written_for = Path(str(state.get("model_file", ""))).name
    levers = ("precision", "activation_checkpointing", "sharding", "optimizer_8bit", "offload_optimizer",
              "offload_activations", "nf4_frozen_weights", "chunked_loss", "optimizer_in_backward", "compile")
    if written_for and written_for != model_file.label and any(
            getattr(plan, k) != getattr(in_file, k) for k in levers):
        raise OomtuneError(f"checkpoint {latest} was written by a run of {written_for} ({plan.describe()}), not of "
                           f"this config's {model_file.label}: resume with that run's config, or pass another "
                           "--run-dir", BAD_INPUT)


def _resumed_settings(cfg: TrainConfig, in_file: TrainConfig, state: dict,
                      given: dict[str, Any]) -> tuple[TrainConfig, tuple[str, ...]]:
    """A resumed run goes on with the `train` settings it was started with (they are in the checkpoint; the same
    seed, schedule and length make it the run it would have been), except those given as flags now. Says which
    of the config file's settings that leaves unused."""
    try:
        saved = from_dict(TrainConfig, state["train"], "train")
    except (KeyError, TypeError, ConfigError):
        return cfg, ()  # a checkpoint without them (or from another version): the config file's
    resumed = dataclasses.replace(saved, run_dir=cfg.run_dir, **{k: v for k, v in given.items() if k != "run_dir"})
    unused = [f"{f.name} {getattr(resumed, f.name)} (the config says {getattr(in_file, f.name)})"
              for f in dataclasses.fields(TrainConfig)
              if f.name not in given and f.name != "run_dir" and getattr(resumed, f.name) != getattr(in_file, f.name)]
    if not unused:
        return resumed, ()
    return resumed, (f"resuming with the checkpoint's train settings: {', '.join(unused)}; pass a flag "
                     "(for example --steps) to change one",)


def resumed_device(state: dict | None, device: str | None, budget: str | None) -> tuple[str | None, str | None,
                                                                                    tuple[str, ...]]:
    """(device, budget, notes): a resumed run trains on the device and in the budget it started with (the
    checkpoint's `run_on`: --device and --budget as given then), except where flags say otherwise now."""
    run_on = (state or {}).get("run_on")
    if not isinstance(run_on, dict):  # a fresh run, or a checkpoint from before run_on
        return device, budget, ()
    taken = []
    if device is None and run_on.get("device") is not None:
        device = run_on["device"]
        taken.append(f"--device {device}")
    if budget is None and device == run_on["device"] and run_on.get("budget") is not None:
        budget = run_on["budget"]
        taken.append(f"--budget {format_bytes(int(budget)).replace(' ', '') if budget.isdigit() else budget}")
    note = (f"resuming with {' '.join(taken)}, as the run started (pass the flag to change it)",) if taken else ()
    return device, budget, note


def plan_for_ranks(plan: Plan, world_size: int, where: str) -> Plan:
    """`plan` (from the config or a checkpoint) on this run's number of ranks, same global batch."""
    if plan.world_size == world_size and (world_size == 1 or plan.sharding != "none"):
        return plan
    scaled = plan.for_world_size(world_size)
    if scaled is None:
        raise OomtuneError(f"{where}: global batch {plan.global_batch_size} cannot be shared out evenly over "
                           f"{world_size} ranks; change --nproc-per-node", BAD_INPUT)
    return scaled


def share_size(plan: Plan, data_batch: int, where: str) -> int:
    """Examples per piece of this rank's share: whole drawn batches, or equal cuts of one."""
    per_rank = plan.global_batch_size // plan.world_size
    piece = min(data_batch, per_rank)
    if (per_rank % data_batch if data_batch <= per_rank else data_batch % per_rank) or piece % plan.micro_batch_size:
        raise OomtuneError(f"{where}: batches of {data_batch} cannot be shared out as {per_rank} examples per rank "
                           f"in micro-batches of {plan.micro_batch_size}", BAD_INPUT)
    return piece


def load_latest(latest: Path) -> tuple[dict, Plan]:
    """The latest checkpoint and its plan. A broken one is never touched: the error names an older one that is
    intact, and how to resume from it."""
    try:
        state = load_checkpoint(latest)
        return state, checkpoint_plan(latest, state)
    except CheckpointError as e:
        older = older_intact(latest)
        if older is None:
            raise
        raise CheckpointError(f"{e.message}. An older checkpoint is intact, {older.name}: move {latest.name} out "
                              f"of {latest.parent} and rerun with --resume to continue from it") from None


def checkpoint_plan(path: Path, st: dict) -> Plan:
    """The plan a checkpoint was written with, checked against its data position."""
    try:
        plan = Plan(**st["plan"])
        batch = int(st["data"]["batch_size"])
        step = int(st["step"])
    except (TypeError, KeyError, ValueError, ConfigError) as e:
        raise CheckpointError(f"checkpoint {path} has an unreadable plan or data position ({first_line(e)})") \
            from None
    if batch % plan.micro_batch_size or plan.global_batch_size % batch or step < 0:
        raise CheckpointError(f"checkpoint {path}: data batch {batch} does not fit plan {plan.describe()}")
    return plan


def device_kind(config: Config, kind: str | None) -> str:
    """Train where the probe ran unless told otherwise: cuda or cpu."""
    found = config.found_by
    if kind is None and found is not None and found.device in ("cuda", "cpu"):
        kind = found.device
        if kind == "cuda" and not torch.cuda.is_available():
            raise OomtuneError(f"the config was probed on cuda ({found.gpu_name}) but PyTorch sees no GPU here; "
                               "pass --device cpu to train on the CPU")
    kind = resolve_kind(kind or "auto")
    if kind not in ("cuda", "cpu"):
        raise OomtuneError(f"--device {kind}: training needs a device that computes (cuda or cpu)")
    return kind


def resolve_device(config: Config, kind: str | None, budget: str | None) -> Device:
    """Train where the probe ran unless told otherwise; on the simulated cpu device also in the budget it
    probed, and accounting like the card the plan was found for (probed on cpu or estimated with --gpu: its
    context, workspaces and allocator, which that budget holds). On cuda the default budget is the card's free
    memory (of the GPU torch.cuda.set_device chose: one per rank)."""
    kind = device_kind(config, kind)
    found = config.found_by
    probed_here = kind == "cpu" and found is not None and found.device == "cpu"
    as_card = kind == "cpu" and found is not None and found.device in ("cpu", "fake") and found.card
    if budget is None and (probed_here or as_card):
        budget = str(found.budget_bytes)
    if not as_card:
        return make_device(kind, budget)
    card = find_gpu(found.card)  # and the margin it was found with (an estimate's --margin 0 too)
    return make_device(kind, budget, card, check_margin(config, None, card))


def check_weights_fit(model_file: ModelFile, plan: Plan, device: Device, world_size: int) -> None:
    """On the simulated cpu device, a budget that the plan's weights, gradients and optimizer state alone exceed is
    bad input (exit 2, before anything is written), as for check and probe: no micro-batch could train. On cuda the
    real run says so itself."""
    if device.kind == "cpu" and world_size == 1:
        check_floor(model_file, plan, device.kind, device.budget_bytes, device.tensor_budget(device.budget_bytes),
                    0.0)
