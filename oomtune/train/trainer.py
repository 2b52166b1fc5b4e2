"""`oomtune train`: the training loop around `step.train_step`, the same step the probe measured.

One optimizer step draws `global_batch / data_batch` batches from the data stream, cuts each into this rank's
micro-batches of the current plan (data.Shares) and hands them to `train_step`. Its parts: `RunState` (state.py,
declared in one place); a `Checkpointer` (a file on one process, a DCP folder on a group); a `RecoveryPolicy`
(recovery.py: what an OOM, a diverged loss or an error mid-run does; the trainer carries it out: `_fall_back`,
`_stop`); `check_losses`, `DataStream`, `Shares` (data.py), `RunLog` (rundir.py: logs, lock), `graceful_stop`.

Exact resume: a checkpoint holds the model, optimizer, scaler, step and the global RNG states. The data come from a
private RNG stream (seed + 1) that is swapped in around every draw, so the model's randomness (dropout) and the
data's never interleave; resuming replays the data stream to its position (step x batches per step) and restores
the global RNGs, so a resumed run computes what an uninterrupted run would have, bit for bit on the same machine.

On several ranks (torchrun, plan.sharding ddp / fsdp) every rank runs this loop on its share of each global batch;
rank 0 alone writes the logs, the config and the adapter (pretrained.py), every rank its part of a checkpoint.
Library code: it reports through `on_event` callbacks and returns a TrainResult; it never prints."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch

from .. import rank_allocation as adalora
from ..config.writing import NotRewritten, rewrite_plan, to_dict
from ..dist.group import LoneOutOfMemory, init
from ..dist.launch import DEFAULT_TIMEOUT_S, launched_by_torchrun
from ..errors import BAD_INPUT, OomtuneError, first_line
from ..memory.devices import is_oom
from ..memory.threads import simulated_threads
from ..model_file import Batch
from ..models.text_data import data_digest
from ..step import Training, build_training, eval_loss, state_bytes, train_step
from .checkpoint import KEEP
from .checkpointer import checkpointer_for, optimizer_class, restore, resume_notes
from .data import DataStream, Shares
from .events import Checkpointed, Event, Note, Started, StepDone, TrainResult
from .inputs import check_inputs, check_weights_fit, device_kind, resolve_device, resumed_device
from .losses import NonFiniteLoss, check_losses, tainted_buffer
from .metrics import StepMetrics, Window
from .notes import built_notes, compile_fallback_notes, data_notes, run_notes
from .pretrained import after_checkpoint
from .recovery import RecoveryPolicy, Retry, Stop, write_relaunch_plan
from .rng import capture_rng, restore_rng, seed_everything
from .rundir import RunLog
from .schedule import lr_at
from .signals import StopRequest, graceful_stop
from .state import Phase, RunState

DATA_SEED_OFFSET, EVAL_SEED_OFFSET = 1, 2  # the data and eval streams' seeds, relative to train.seed
RANK_SEED_STRIDE = 1_000_003  # rank r > 0 seeds its own RNG (dropout) at seed + r x this: no stream's seed


class Trainer:
    """One invocation of `oomtune train` (on one rank). Build it (every check that can fail on bad input runs
    here, before any file is written), then `run()`.

    `rank_budgets` ({rank: budget}) gives some ranks another simulated budget than `budget` (the cpu device: to
    rehearse one rank running out of memory); `dist_timeout` is how long a collective waits for the others."""

    def __init__(self, config_path: str | Path, *, overrides: dict[str, Any] | None = None,
                 device: str | None = None, budget: str | None = None, resume: bool = False,
                 on_event: Callable[[Event], None] | None = None, rank_budgets: dict[int, str] | None = None,
                 dist_timeout: float = DEFAULT_TIMEOUT_S):
        world = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1
        self.inputs = inputs = check_inputs(config_path, overrides, resume=resume, world_size=world)
        self.cfg, self.model_file, self.on_event = inputs.cfg, inputs.model_file, on_event or (lambda e: None)
        device, budget, resumed_on = resumed_device(inputs.resume_state, device, budget)
        kind = device_kind(inputs.file_config, device)
        self.dist = init(kind, inputs.plan.sharding, dist_timeout)  # cuda: also picks this rank's GPU
        self.log = RunLog(inputs.run_dir, enabled=self.dist.is_main)  # rank 0 writes the run dir's logs
        budget = rank_budgets.get(self.dist.rank, budget) if rank_budgets else budget
        self.device = resolve_device(inputs.file_config, kind, budget)
        check_weights_fit(self.model_file, inputs.plan, self.device, world)
        self.cuda = self.device.torch_device.type == "cuda"  # run_on, for a resume: on cpu the budget resolved
        self.run_on = {"device": kind, "budget": budget if self.cuda or budget else str(self.device.budget_bytes)}
        step = int(inputs.resume_state["step"]) if inputs.resume_state else 0
        self.state = RunState(inputs.plan, inputs.file_config, step=step, start_step=step,
                              last_checkpoint=inputs.resumed_from,
                              checkpoint_step=step if inputs.resume_state else None)
        self.data_hook = "train_batches" if self.model_file.has("train_batches") else "make_batch"
        self.evaluates = self.model_file.has("eval_batches")
        self.shares = Shares(self.dist, inputs.data_batch, inputs.piece, f"{self.model_file.label}: {self.data_hook}()")
        self.checkpointer = checkpointer_for(self.dist)
        self.recovery = RecoveryPolicy(inputs.config_path, self.cfg, collective=self.checkpointer.collective,
                                       main=self.dist.is_main, fsdp=inputs.plan.sharding == "fsdp",
                                       resumed_from=inputs.resumed_from, run_dir=inputs.run_dir)
        self.notes = run_notes(inputs, step, device, self.device) + [Note(n) for n in resumed_on]  # said later
        self.t: Training | None = None  # built by run()
        self.metrics = StepMetrics(self.dist, self.device, self.log)

    @property
    def batches_per_step(self) -> int:
        """Batches of the global stream per optimizer step (all ranks together)."""
        return self.state.plan.global_batch_size // self.inputs.data_batch

    # -- the run -------------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        found = self.inputs.file_config.found_by  # (cpu: as many threads as the probe measured tokens/s with)
        with self.log, simulated_threads(self.device.kind, found.threads if found else None) as threads:
            self.notes += [Note(threads.note(self.device.kind))] if threads else []
            return self._run(time.perf_counter())  # (the run dir's lock, taken in _prepare, is let go however it ends)

    def _run(self, started: float) -> TrainResult:
        base_lrs = self._prepare()
        stream = DataStream(self.model_file, self.data_hook, self.inputs.data_batch, self.state.plan.context_length,
                            self.device, self.cfg.seed + DATA_SEED_OFFSET)
        failure: Exception | None = None
        first_loss = last_loss = last_eval = stopping = None
        with graceful_stop() as stop:
            try:
                if self.inputs.resumed_from is not None and self.state.step < self.cfg.steps:
                    self.state.phase = Phase.DATA
                    n = self.state.step * self.batches_per_step  # replay the data stream to where it stood
                    self.on_event(Note(f"replaying the data to step {self.state.step}: {n:,} batches drawn, dropped"))
                    stream.skip(n, until=(lambda: stop.signal_name is not None) if self.dist.world_size == 1 else None)
                    stream.notices.clear()  # (told by the run that drew them)
                    stopping = stop.agreed(self.dist)
                if stopping is None:
                    first_loss, last_loss, last_eval, stopping = self._loop(stream, base_lrs, stop)
            except NonFiniteLoss as e:
                failure = e.with_traceback(None)  # its frames hold the step's tensors; nothing there to debug
            except Exception as e:
                failure = e
            if failure is not None and stop.forced:  # the second Ctrl-C, swallowed where Python drops it (a
                raise KeyboardInterrupt from None  # finalizer) and left state half-done: not the model's error
            if isinstance(failure, NonFiniteLoss):  # outside the except blocks: their frames hold the step's tensors
                tainted = tainted_buffer(self.t.module, self.dist)
                self._stop(self.recovery.after_divergence(self.state, failure.values, tainted))
            if failure is not None:
                self._stop(self.recovery.after_error(self.state, failure))
            interrupted = stopping is not None and self.state.step < self.cfg.steps
            if interrupted:
                self.on_event(Note(f"{stopping}: stopped after step {self.state.step}"))
                if not self.state.saved_now:
                    self._checkpoint("interrupted")
                self.log.event("interrupted", step=self.state.step, signal=stopping)
        if not interrupted:
            self.log.event("finished", step=self.state.step)
        s = self.state
        return TrainResult(s.step, self.cfg.steps, s.plan, interrupted, self.inputs.run_dir, s.last_checkpoint,
                           first_loss, last_loss, last_eval, tuple(s.fallbacks), time.perf_counter() - started,
                           config_updated=bool(s.fallbacks) and s.file_config.plan == s.plan, start_step=s.start_step)

    def _prepare(self) -> list[float]:
        """Build the model (and load the checkpoint) first: a checkpoint that does not fit the model is bad input,
        and bad input writes nothing. Then the run dir and the start event. -> each param group's lr ratio."""
        cfg, inputs = self.cfg, self.inputs
        seed_everything(cfg.seed, self.cuda)  # every rank alike: the same initial weights
        self.t = self._build()
        if self.dist.rank > 0:  # dropout differs between ranks (rank 0 draws what a single process would)
            seed_everything(cfg.seed + self.dist.rank * RANK_SEED_STRIDE, self.cuda)
        base_lrs = [g["lr"] / cfg.lr for g in self.t.optimizer.param_groups]  # the optimizer hook's per-group ratio
        if inputs.resume_state:
            self._restore(inputs.resume_state)
            inputs.resume_state = None  # free the loaded copy
        self.log.open(clean=self.dist.is_main, fresh=inputs.resumed_from is None)  # its lock: rank 0, to run()'s end
        self.log.truncate_metrics(self.state.step)
        resumed = inputs.resumed_from
        self.log.event("resume" if resumed else "start", step=self.state.step, plan=to_dict(self.state.plan),
                       train=to_dict(cfg), device=self.device.name, config=str(inputs.config_path),
                       checkpoint=resumed.name if resumed else None)
        self.on_event(Started(self.state.plan, cfg, self.state.step, self.device.name, inputs.run_dir, self.data_hook,
                              self.evaluates, inputs.resumed_from))
        for note in self.notes + built_notes(self.t, inputs) + data_notes(self.t, inputs.model_file, self.device):
            self.on_event(note)
        return base_lrs

    def _loop(self, stream: DataStream, base_lrs: list[float],
              stop: StopRequest) -> tuple[float | None, float | None, float | None, str | None]:
        """Optimizer steps until train.steps or a stop signal -> (first logged loss, last logged loss, last eval
        loss, the signal every rank agreed to stop on)."""
        cfg, s = self.cfg, self.state
        first_loss = last_loss = last_eval = stopping = None
        window = Window()
        while s.step < cfg.steps and stopping is None:
            s.step_rng = capture_rng(self.cuda)
            lr = lr_at(s.step, cfg)
            for group, ratio in zip(self.t.optimizer.param_groups, base_lrs, strict=True):
                group["lr"] = lr * ratio
            tic = time.perf_counter()
            loss, step_peak = self._attempt(self._train_step, Phase.FORWARD, [],
                                            lambda: self.shares.share(stream.take(self.batches_per_step)))
            window.seconds += time.perf_counter() - tic  # synchronized: measure() waits for the device
            s.step, s.phase = s.step + 1, Phase.AFTER
            self._tell(stream)
            window.tokens += s.plan.tokens_per_step
            window.peak = max(window.peak, step_peak)
            stopping = stop.agreed(self.dist)
            eval_now = self.evaluates and (s.step % cfg.eval_interval == 0 or s.step == cfg.steps)
            metrics = None
            if (s.step % cfg.log_every_n_steps == 0 or s.step in (1, cfg.steps) or eval_now
                    or stopping is not None):  # step 1: the starting loss, ln(vocab) for a fresh LM
                metrics = self.metrics.line(s, float(loss), lr, window, self._evaluate if eval_now else None,
                                            state_bytes(self.t), self.on_event)
                last_loss = metrics["loss"]
                first_loss = last_loss if first_loss is None else first_loss
                last_eval = metrics.get("eval_loss", last_eval)
                window = Window()
            self.on_event(StepDone(s.step, cfg.steps, metrics))
            if eval_now and stopping is None:  # a signal during the evaluation: stop after this step, not the next
                stopping = stop.agreed(self.dist)
            if s.step % cfg.checkpoint_interval == 0 or s.step == cfg.steps:
                self._checkpoint("final" if s.step == cfg.steps else "interval")
        return first_loss, last_loss, last_eval, stopping

    def _train_step(self, batches: list[Batch]) -> torch.Tensor:
        s = self.state  # (the step's index: AdaLoRA's schedule reads it)
        micro_batches, weights = self.shares.train_cut(batches, s.plan.micro_batch_size)  # (a short batch: weights)
        return train_step(self.t, micro_batches, s.step, weights)

    def _tell(self, stream: DataStream) -> None:
        """What drawing this step's batches noticed (a new epoch, an empty batch skipped); compiled calls run eager."""
        for notice in stream.notices:
            self.log.event(notice.event, step=self.state.step, **notice.fields)
            self.on_event(Note(f"{notice.message} (step {self.state.step})"))
        stream.notices.clear()
        for note in compile_fallback_notes(self.state.step):
            self.on_event(note)

    def _evaluate(self) -> tuple[float, int]:
        def draw() -> list[Batch]:
            stream = DataStream(self.model_file, "eval_batches", self.inputs.data_batch, self.state.plan.context_length,
                                self.device, self.cfg.seed + EVAL_SEED_OFFSET)  # the same batches every time
            return stream.take_once(self.cfg.eval_steps)  # a held-out set shorter than eval_steps: once

        def work(batches: list[Batch]) -> tuple[float, int]:
            mine, examples = self.shares.eval_share(batches, self.state.plan.micro_batch_size)
            return float(eval_loss(self.t, mine, examples)) * sum(examples), sum(examples)

        (total, count), peak = self._attempt(work, Phase.EVAL, [], draw)
        total, count = self.dist.sum(total, count)
        if self.cuda:
            torch.cuda.empty_cache()  # give back the eval batches' blocks before training resumes
        return total / max(count, 1), peak

    # -- out of memory, divergence, errors ------------------------------------------------------------
    def _attempt(self, work: Callable[[list[Batch]], Any], phase: Phase, batches: list[Batch],
                 draw: Callable[[], list[Batch]]) -> tuple[Any, int]:
        """Draw `batches` once (a retry runs the very same ones), then run `work(batches)` under the device's
        memory accounting; on OOM carry out what the recovery policy decides. -> (result, peak bytes)."""
        s = self.state
        while True:
            oom, lone = None, False
            try:
                if not batches:
                    s.phase = Phase.EVAL_DATA if phase is Phase.EVAL else Phase.DATA
                    # outside the accounting: host-side work (a corpus in RAM, tokenizing) is not device
                    # memory; what the batches themselves hold is counted on a simulated device
                    batches.extend(draw())
                    self.device.account(batches)
                with self.device.measure() as reading:
                    s.phase = phase
                    result = work(batches)
            except LoneOutOfMemory as e:  # only this rank ran out, inside FSDP's collectives
                oom, lone = e.message, True
            except Exception as e:
                if not is_oom(e):
                    raise
                oom = first_line(e)
            if oom is None:
                s.good_plan = s.plan
                if s.plan_dirty:
                    self._save_plan()
                return result, reading.peak_bytes
            decision = self.recovery.after_oom(s, oom, lone)  # outside the except block: its frames are gone
            if isinstance(decision, Stop):
                self._stop(decision)
            self._fall_back(decision)

    def _fall_back(self, retry: Retry) -> None:
        s, fallback = self.state, retry.fallback
        self._forget_step(retry.rewind_rng)
        s.fallbacks.append(fallback)
        self.log.event("oom_fallback", step=fallback.step, phase=fallback.phase, message=fallback.message,
                       old_plan=to_dict(s.plan), new_plan=to_dict(retry.plan))
        s.plan, s.plan_dirty = retry.plan, True
        self.on_event(fallback)

    def _save_plan(self) -> None:
        """Write the plan that now works back into the config file (atomically), so the next run starts there."""
        s, path = self.state, self.inputs.config_path
        s.plan_dirty = False
        step = s.fallbacks[-1].step
        note = (f"plan updated by `oomtune train` at step {step}: out of memory at micro-batch "
                f"{s.file_config.plan.micro_batch_size}, now {s.plan.describe()}")
        try:
            s.file_config = rewrite_plan(path, s.file_config.plan, s.plan, note)  # (as on disk now, but the plan)
        except (OSError, NotRewritten) as e:
            self.on_event(Note(f"could not update {path} with the new plan: {e}", warning=True))
            return
        self.log.event("config_updated", step=step, path=str(path), plan=to_dict(s.plan))
        self.on_event(Note(f"updated {path}: plan is now {s.plan.describe()}"))

    def _stop(self, stop: Stop) -> NoReturn:
        """Carry out a stop: forget the step in flight, save, write the relaunch plan, log, raise its one line."""
        s = self.state
        if stop.forget_step:
            self._forget_step(stop.rewind_rng)
        else:
            self.device.release()
        if stop.restore_plan is not None:
            s.plan = stop.restore_plan
        line = stop.line
        if stop.save is not None:
            try:
                self._checkpoint(stop.save, keep=stop.keep)
            except OomtuneError as w:  # a full disk: say both, where the decision knows how
                if stop.if_save_fails is None:
                    raise
                line = stop.if_save_fails.replace("{error}", w.message)
        line = line.replace("{checkpoint}", str(s.last_checkpoint))
        exit_code = stop.exit_code
        if stop.relaunch_plan is not None and stop.writes:
            line, exit_code = write_relaunch_plan(self.inputs.config_path, s.file_config.plan, stop, line)
        if stop.event is not None:
            named = ({"checkpoint": s.last_checkpoint.name if s.last_checkpoint else None}
                     if stop.name_checkpoint else {})
            try:
                self.log.event(stop.event, always=stop.writes, **stop.fields, **named)
            except OomtuneError:
                pass  # the run dir cannot be written: the stop's own line says more
        if stop.reraise is not None:
            raise stop.reraise
        raise stop.error_type(line, exit_code) from stop.cause

    def _forget_step(self, rewind_rng: bool) -> None:
        """Drop what the step in flight did (half-accumulated gradients, its RNG draws): the state is then that of
        the last finished step, ready to be retried or checkpointed."""
        self.t.model.zero_grad(set_to_none=True)
        self.t.micro_losses = None
        self.device.release()
        if rewind_rng:
            restore_rng(self.state.step_rng, self.cuda)

    def _on_phase(self, name: str) -> None:  # (optimizer_in_backward: the update runs in backward)
        self.state.phase = Phase.OPTIMIZER if name == "backward" and self.t.plan.optimizer_in_backward else Phase(name)
        if self.state.phase is Phase.OPTIMIZER:  # the micro-batches' losses known, the update not yet applied
            check_losses(self.t.micro_losses, self.dist)

    # -- building, checkpoints -------------------------------------------------------------------------
    def _build(self) -> Training:
        oom = None
        try:
            with self.device.measure():
                t = build_training(self.model_file, self.state.plan, self.device, lr=self.cfg.lr,
                                   clip_grad_norm=self.cfg.clip_grad_norm, weight_decay=self.cfg.weight_decay,
                                   dist=self.dist)
        except Exception as e:
            if not is_oom(e):
                raise
            oom = first_line(e)
        if oom is not None:  # before any step: the memory given is too small for the model, bad input
            self.device.release()
            raise OomtuneError(f"out of memory building the model on {self.device.name}: the weights alone do not "
                               f"fit ({oom}); give a larger --budget or free memory", BAD_INPUT)
        t.on_phase = self._on_phase
        return t

    def _checkpoint(self, reason: str, keep: int = KEEP) -> Path:
        """Save the state of the last finished step (`state.step`); keep the newest `keep` checkpoints."""
        s, t = self.state, self.t
        s.phase = Phase.CHECKPOINT  # an error while writing: no second try
        meta = {
            "step": s.step, "plan": to_dict(s.plan),
            "data": {"batch_size": self.inputs.data_batch, "batches": s.step * self.batches_per_step,
                     "hook": self.data_hook, **data_digest(self.model_file)},
            "scaler": t.scaler.state_dict(), "train": to_dict(self.cfg), "model_file": str(self.model_file.path),
            "torch_version": str(torch.__version__), "run_on": self.run_on,
            "optimizer_class": optimizer_class(t.optimizer), **adalora.saved(t.rank_allocator)}  # AdaLoRA's scores
        path = self.checkpointer.save(self.inputs.run_dir, meta, capture_rng(self.cuda), t, keep)
        s.last_checkpoint, s.checkpoint_step = path, s.step
        kept = after_checkpoint(t.module, self.inputs.run_dir, reason, self.cfg.save_adapter, s.plan, self.dist)
        self.log.event("checkpoint", step=s.step, path=path.name, reason=reason)
        self.on_event(Checkpointed(s.step, path, reason, kept))
        s.phase = Phase.AFTER
        return path

    def _restore(self, st: dict) -> None:
        t, path = self.t, self.inputs.resumed_from
        restore(self.checkpointer, path, st, t, self.device, self.cfg.weight_decay, self.model_file.label)
        rng = self.checkpointer.rng(path, st, self.dist.rank)
        if rng is not None:
            restore_rng(rng, self.cuda)
        elif self.dist.is_main:
            self.notes.append(Note("the checkpoint has no RNG state for some ranks (it had fewer): they keep their "
                                   "own seed, so dropout will not repeat the original run's"))
        self.notes.extend(resume_notes(st, self.state.plan, self.state.file_config.plan, self.data_hook, self.cfg))


def train(config_path: str | Path, *, overrides: dict[str, Any] | None = None, device: str | None = None,
          budget: str | None = None, resume: bool = False,
          on_event: Callable[[Event], None] | None = None) -> TrainResult:
    """Train with the config's plan. Bad input raises OomtuneError before any file is written."""
    return Trainer(config_path, overrides=overrides, device=device, budget=budget, resume=resume,
                   on_event=on_event).run()
