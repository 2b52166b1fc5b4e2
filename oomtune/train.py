"""`oomtune train`: the training loop around `step.train_step`, the same step the probe measured.

One optimizer step draws `global_batch / data_batch` batches from the data stream, cuts each into
micro-batches of the current plan and hands them to `train_step`. An out-of-memory error in a step is
caught and the plan halved (`fallback.py`); the run dir's metrics and events are written by `rundir.py`; the
device, signals and NVML by `runtime.py`; the events the CLI renders are in `train_events.py`.

On several ranks (torchrun, plan.sharding ddp / fsdp) every rank runs this loop on its share of each global
batch (`train_ranks.py`); rank 0 alone writes the run dir's logs and the config, every rank its part of a
checkpoint.

Exact resume: a checkpoint holds the model, optimizer, scaler, step and the global RNG states. The data
come from a private RNG stream (seed + 1) that is swapped in around every draw, so the model's randomness
(dropout) and the data's never interleave; resuming replays the data stream to its position
(step x batches per step) and restores the global RNGs, so a resumed run computes what an uninterrupted
run would have, bit for bit on the same machine.

Library code: it reports through `on_event` callbacks and returns a TrainResult; it never prints.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import parallel
from .checkpoint import capture_rng, latest_checkpoint, remove, seed_everything, stale_temp_files
from .data import DataStream
from .devices import is_oom
from .errors import BAD_INPUT, ConfigError, ModelFileError, OomtuneError, first_line
from .fallback import FailureMixin, FallbackMixin, LossWatch, NonFiniteLoss, rewrite_plan, smaller_plan
from .model_file import Batch, ModelFile, load_model_file
from .plan import Config, Plan, TrainConfig, from_dict, load_config, to_dict
from .rundir import METRICS, RunLog, check_run_dir, no_checkpoint_message
from .runtime import StopRequest, device_kind, graceful_stop, nvml_used_bytes, resolve_device
from .step import Training, build_training, eval_loss, state_bytes, train_step
from .train_events import Checkpointed, Event, Note, OomFallback, Started, StepDone, TrainResult
from .train_ranks import RanksMixin, load_latest, plan_for_ranks, share_size

__all__ = ["Checkpointed", "Event", "Note", "OomFallback", "Started", "StepDone", "TrainResult", "Trainer",
           "lr_at", "rewrite_plan", "smaller_plan", "train"]

DATA_SEED_OFFSET, EVAL_SEED_OFFSET = 1, 2  # the data and eval streams' seeds, relative to train.seed
RANK_SEED_STRIDE = 1_000_003  # rank r > 0 seeds its own RNG (dropout) at seed + r x this: no stream's seed


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup to cfg.lr over warmup_steps, then
    cosine decay to min_lr at cfg.steps (nanoGPT's schedule)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


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
        raise ConfigError(e.message.replace("train.", "--").replace("_", "-")) from None
    try:
        model_file = load_model_file(file_config.model_path(config_path))
    except ModelFileError as e:
        raise ModelFileError(f"{config_path}: {e.message}") from None
    run_dir = Path(cfg.run_dir)
    check_run_dir(run_dir)  # a file, an unwritable folder: bad input, before the model is built
    state, latest = None, None
    if resume:
        latest = latest_checkpoint(run_dir)
        if latest is None:
            raise OomtuneError(no_checkpoint_message(run_dir), BAD_INPUT)
        state, plan = load_latest(latest)
        cfg, notes = _resumed_settings(cfg, file_config.train, state, given)
        smaller = file_config.plan
        if (smaller.micro_batch_size < plan.micro_batch_size and plan.micro_batch_size % smaller.micro_batch_size == 0
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
    data_batch = state["data"]["batch_size"] if state else plan.micro_batch_size
    return Inputs(config_path, file_config, cfg, model_file, run_dir, plan, data_batch,
                  share_size(plan, data_batch, where), state, latest, notes)


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


class Trainer(FallbackMixin, FailureMixin, RanksMixin):
    """One invocation of `oomtune train` (on one rank). Build it (every check that can fail on bad input runs
    here, before any file is written), then `run()`.

    `rank_budgets` ({rank: budget}) gives some ranks another simulated budget than `budget` (the cpu device: to
    rehearse one rank running out of memory); `dist_timeout` is how long a collective waits for the others."""

    def __init__(self, config_path: str | Path, *, overrides: dict[str, Any] | None = None,
                 device: str | None = None, budget: str | None = None, resume: bool = False,
                 on_event: Callable[[Event], None] | None = None, rank_budgets: dict[int, str] | None = None,
                 dist_timeout: float = parallel.DEFAULT_TIMEOUT_S):
        launched = parallel.launched_by_torchrun()
        self.rank = parallel.env_rank()
        inputs = check_inputs(config_path, overrides, resume=resume,
                              world_size=int(os.environ["WORLD_SIZE"]) if launched else 1)
        for f in dataclasses.fields(inputs):
            setattr(self, f.name, getattr(inputs, f.name))
        self.on_event = on_event or (lambda event: None)
        self.log = RunLog(self.run_dir, enabled=self.rank == 0)  # rank 0 writes the run dir's logs
        kind = device_kind(self.file_config, device)
        self.dist = parallel.init(kind, self.plan.sharding, dist_timeout)  # cuda: also picks this rank's GPU
        if rank_budgets and self.rank in rank_budgets:
            budget = rank_budgets[self.rank]
        self.device = resolve_device(self.file_config, kind, budget)
        self.cuda = self.device.torch_device.type == "cuda"

    # -- small helpers -------------------------------------------------------------------------------
    def _emit(self, event: Event) -> None:
        self.on_event(event)

    def _set_phase(self, phase: str) -> None:
        self.phase = phase
        if phase == "optimizer":  # the micro-batches are done, the update not yet applied
            self._check_losses()

    # -- evaluation ----------------------------------------------------------------------------------
    def _evaluate(self) -> tuple[float, int]:
        def draw() -> list[Batch]:
            stream = DataStream(self.model_file, "eval_batches", self.data_batch, self.plan.context_length,
                                self.device, self.cfg.seed + EVAL_SEED_OFFSET)  # the same batches every time
            return [stream.next() for _ in range(self.cfg.eval_steps)]

        def work(batches: list[Batch]) -> tuple[float, int]:
            mine = self._eval_share(batches)
            return float(eval_loss(self.t, mine)) * len(mine), len(mine)

        (total, count), peak = self._attempt(work, "eval", [], draw)
        if self.dist is not None:
            total, count = self.dist.sum(total, count)
        value = total / max(count, 1)
        if self.cuda:
            torch.cuda.empty_cache()  # give back the eval batches' blocks before training resumes
        return value, peak

    # -- the loop ------------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        started = time.perf_counter()
        cfg, mf = self.cfg, self.model_file
        self.fallbacks: list[OomFallback] = []
        self.plan_dirty = False
        self.good_plan = self.plan
        self.last_checkpoint: Path | None = self.resumed_from
        self.step = int(self.resume_state["step"]) if self.resume_state else 0
        self.checkpoint_step = self.step if self.resume_state else None
        self.data_hook = "train_batches" if mf.has("train_batches") else "make_batch"
        evaluates = mf.has("eval_batches")
        self.notes = [Note(n) for n in self.resume_notes]  # said once training has started

        # build and load first: a checkpoint that does not fit the model is bad input, and bad input writes nothing
        seed_everything(cfg.seed, self.cuda)  # every rank alike: the same initial weights
        self.t = self._build()
        if self.rank > 0:  # dropout differs between ranks (rank 0 draws what a single process would)
            seed_everything(cfg.seed + self.rank * RANK_SEED_STRIDE, self.cuda)
        base_lrs = [g["lr"] / cfg.lr for g in self.t.optimizer.param_groups]  # the optimizer hook's per-group ratio
        if self.resume_state:
            self._restore(self.resume_state)
            self.resume_state = None  # free the loaded copy

        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OomtuneError(f"run dir {self.run_dir} cannot be created: {(e.strerror or str(e)).lower()}",
                               BAD_INPUT) from None
        if self.rank == 0:
            for tmp in stale_temp_files(self.run_dir):  # a write that was killed: never a checkpoint
                remove(tmp)
        self.log.truncate_metrics(self.step)
        self.log.event("resume" if self.resumed_from else "start", step=self.step, plan=to_dict(self.plan),
                        train=to_dict(cfg), device=self.device.name, config=str(self.config_path),
                        checkpoint=self.resumed_from.name if self.resumed_from else None)
        self._emit(Started(self.plan, cfg, self.step, self.device.name, self.run_dir, self.data_hook, evaluates,
                           self.resumed_from))
        for note in self.notes:
            self._emit(note)
        if self.data_hook == "make_batch":
            self._emit(Note(f"{mf.label} has no train_batches(): training on make_batch(), random synthetic data "
                            "(the loss shows the loop runs, not that the model learns)", warning=True))
        if not evaluates:
            self._emit(Note(f"{mf.label} has no eval_batches(): no evaluation", warning=True))

        stream = DataStream(mf, self.data_hook, self.data_batch, self.plan.context_length, self.device,
                            cfg.seed + DATA_SEED_OFFSET)
        self.start_step = self.step  # this invocation's first; at or past cfg.steps: nothing to do (TrainResult)
        self.t.model_file = self.watch = LossWatch(self.t.model_file)  # a NaN loss stops before its update
        failure: Exception | None = None
        with graceful_stop() as stop:
            try:
                if self.resumed_from is not None and self.step < cfg.steps:
                    self.phase = "data"
                    stream.skip(self.step * self.batches_per_step)  # replay the data stream to where it stood
                first_loss, last_loss, last_eval, stopping = self._loop(stream, evaluates, base_lrs, stop)
            except NonFiniteLoss as e:
                failure = e.with_traceback(None)  # its frames hold the step's tensors; nothing there to debug
            except Exception as e:
                failure = e
            if isinstance(failure, NonFiniteLoss):  # outside the except blocks (see fallback.py)
                self._stop_diverged(failure)
            if failure is not None:
                self._stop_on_error(failure)
            interrupted = stopping is not None and self.step < cfg.steps
            if interrupted:
                self._emit(Note(f"{stopping}: stopped after step {self.step}"))
                if self.checkpoint_step != self.step:
                    self._checkpoint("interrupted")
                self.log.event("interrupted", step=self.step, signal=stopping)
        if not interrupted:
            self.log.event("finished", step=self.step)
        return TrainResult(self.step, cfg.steps, self.plan, interrupted, self.run_dir, self.last_checkpoint,
                           first_loss, last_loss, last_eval, tuple(self.fallbacks), time.perf_counter() - started,
                           config_updated=bool(self.fallbacks) and self.file_config.plan == self.plan,
                           start_step=self.start_step)

    def _loop(self, stream: DataStream, evaluates: bool, base_lrs: list[float],
              stop: StopRequest) -> tuple[float | None, float | None, float | None, str | None]:
        """Optimizer steps until train.steps or a stop signal -> (first logged loss, last logged loss, last eval
        loss, the signal every rank agreed to stop on)."""
        cfg = self.cfg
        first_loss = last_loss = last_eval = None
        tokens = 0
        seconds = 0.0
        peak = 0
        stopping = None
        while self.step < cfg.steps and stopping is None:
            self.step_rng = capture_rng(self.cuda)
            lr = lr_at(self.step, cfg)
            for group, ratio in zip(self.t.optimizer.param_groups, base_lrs, strict=True):
                group["lr"] = lr * ratio
            tic = time.perf_counter()
            loss, step_peak = self._attempt(self._train_step, "forward", [],
                                            lambda: self._share(stream.take(self.batches_per_step)))
            seconds += time.perf_counter() - tic  # synchronized: measure() waits for the device
            self.step += 1
            self.phase = "after"  # the step has finished: an error from here on leaves a whole state behind
            tokens += self.plan.tokens_per_step
            peak = max(peak, step_peak)
            stopping = self._stop_over_ranks(stop.signal_name)

            eval_now = evaluates and (self.step % cfg.eval_interval == 0 or self.step == cfg.steps)
            metrics = None
            if (self.step % cfg.log_every_n_steps == 0 or self.step in (1, cfg.steps) or eval_now
                    or stopping is not None):  # step 1: the starting loss, ln(vocab) for a fresh LM
                last_loss = self._mean_over_ranks(float(loss))  # a sync point, once per logged step
                first_loss = last_loss if first_loss is None else first_loss
                metrics = {"step": self.step, "loss": last_loss, "lr": lr,
                           "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
                           "peak_bytes": self._max_over_ranks(peak)}  # the rank that needs the most
                if self.cuda:
                    metrics["nvml_used_bytes"] = self._nvml()
                if eval_now:
                    last_eval, eval_peak = self._evaluate()
                    metrics["eval_loss"] = last_eval
                    metrics["peak_bytes"] = self._max_over_ranks(max(peak, eval_peak))
                    if not math.isfinite(last_eval):  # written as null; training itself stops on a NaN loss
                        self._emit(Note(f"the eval loss is {last_eval} at step {self.step}", warning=True))
                metrics["state_bytes"] = self._max_over_ranks(state_bytes(self.t))  # weights+grads+optimizer
                metrics["micro_batch_size"] = self.plan.micro_batch_size  # changes after an OOM fallback
                metrics["grad_accum_steps"] = self.plan.grad_accum_steps
                self.log.metrics(metrics)
                tokens, seconds, peak = 0, 0.0, 0
            self._emit(StepDone(self.step, cfg.steps, metrics))
            if self.step % cfg.checkpoint_interval == 0 or self.step == cfg.steps:
                self._checkpoint("final" if self.step == cfg.steps else "interval")
        return first_loss, last_loss, last_eval, stopping

    def _train_step(self, batches: list[Batch]) -> torch.Tensor:
        self.watch.losses = []  # this attempt's (a retry after an out-of-memory error starts them over)
        return train_step(self.t, self._micro_batches(batches))

    def _account(self, *objs) -> None:
        """Count tensors made outside `measure()` on a simulated device (a no-op on cuda: the allocator sees
        everything)."""
        tracker = getattr(self.device, "tracker", None)
        if tracker is not None:
            tracker.track(*objs)

    def _build(self) -> Training:
        def work():
            return build_training(self.model_file, self.plan, self.device, lr=self.cfg.lr,
                                  clip_grad_norm=self.cfg.clip_grad_norm, weight_decay=self.cfg.weight_decay,
                                  dist=self.dist)

        oom = None
        try:
            with self.device.measure():
                t = work()
        except Exception as e:
            if not is_oom(e):
                raise
            oom = first_line(e)
        if oom is not None:  # before any step: the memory given is too small for the model, bad input
            self.device.release()
            raise OomtuneError(f"out of memory building the model on {self.device.name}: the weights alone do not "
                               f"fit ({oom}); give a larger --budget or free memory", BAD_INPUT)
        t.on_phase = self._set_phase
        return t

    def _nvml(self) -> int | None:
        now = time.monotonic()
        if now - getattr(self, "_nvml_at", -1e9) >= 2.0:  # NVML init + query costs milliseconds: not every step
            self._nvml_at = now
            try:
                self._nvml_last = nvml_used_bytes(self.device)
            except Exception:
                self._nvml_last = None
        return getattr(self, "_nvml_last", None)


def train(config_path: str | Path, *, overrides: dict[str, Any] | None = None, device: str | None = None,
          budget: str | None = None, resume: bool = False,
          on_event: Callable[[Event], None] | None = None) -> TrainResult:
    """Train with the config's plan. Bad input raises OomtuneError before any file is written."""
    return Trainer(config_path, overrides=overrides, device=device, budget=budget, resume=resume,
                   on_event=on_event).run()

