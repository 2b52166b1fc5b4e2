"""How `oomtune train` survives or stops: the runtime out-of-memory fallback, a diverged (NaN / infinite) loss,
and an error mid-run.

An OOM in a step (a longer real batch, fragmentation) is caught; outside the `except` block the gradients are
dropped and memory given back, the micro-batch is halved and the accumulation doubled (the global batch stays
exact), and the same batches are retried. Once the smaller plan has run, the config file is rewritten with it
(only the plan's numbers are edited, so a person's comments survive).

A non-finite training loss in any micro-batch stops the run before that step's optimizer update (`LossWatch`
records the losses, checked once a step when the step reaches its optimizer phase), with a checkpoint of the last
finished step, whose loss was finite. There is no skipping of a bad batch: a NaN from one batch or from a run
that diverged stop alike, and the message says which step. (fp16's GradScaler skipping a step whose *gradients*
overflowed is not a stop: the loss was finite, the scale drops and training goes on.)

An error mid-run (a model-file hook raising, eval_batches yielding nothing) saves the last finished step too, when
it is newer than the last checkpoint, so that `--resume` continues once the problem is fixed.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
import yaml

from .checkpoint import KEEP, restore_rng
from .config_text import keep_unchanged_text, parse
from .devices import is_oom
from .errors import NO_FIT, OOM_RELAUNCH, ConfigError, ModelFileError, OomtuneError, first_line
from .files import atomic_write
from .model_file import Batch
from .parallel import LoneOutOfMemory
from .plan import Config, Plan, dump_config, from_dict, to_dict
from .train_events import Note, OomFallback


def smaller_plan(plan: Plan) -> Plan | None:
    """After an OOM: the largest micro-batch that divides the current one and is at most half of it, with
    the accumulation raised so the global batch is unchanged (8 x 2 -> 4 x 4; 6 -> 3 x 2; 5 -> 1 x 5).
    None at micro-batch 1."""
    m = plan.micro_batch_size
    smaller = next((d for d in range(m // 2, 0, -1) if m % d == 0), None)
    if smaller is None:
        return None
    return dataclasses.replace(plan, micro_batch_size=smaller,
                               grad_accum_steps=plan.global_batch_size // (smaller * plan.world_size))


_PLAN_KEY = re.compile(r"^(\s+)(micro_batch_size|grad_accum_steps|global_batch_size)(\s*:\s*)(\d+)(.*)$")


def rewrite_plan(path: Path, config: Config, plan: Plan, note: str) -> None:
    """Replace the config file's plan with `plan`, atomically. The numbers are edited in place where the file
    has the block layout `oomtune probe` writes, so a person's comments and edits survive; the result is read
    back and must equal the intended config, else the whole file is written out fresh."""
    want = dataclasses.replace(config, plan=plan)
    text = path.read_text()
    lines, in_plan = text.splitlines(keepends=True), False
    for i, line in enumerate(lines):
        if re.match(r"^plan\s*:\s*(#.*)?$", line):
            in_plan = True
        elif in_plan and re.match(r"^[^\s#]", line):
            in_plan = False  # the next top-level key
        elif in_plan and (m := _PLAN_KEY.match(line.rstrip("\r\n"))):
            lines[i] = f"{m[1]}{m[2]}{m[3]}{getattr(plan, m[2])}{m[5]}\n"
    edited = f"# {note}\n" + "".join(lines)
    try:
        same = from_dict(Config, parse(edited)) == want
    except (ConfigError, yaml.YAMLError):
        same = False
    atomic_write(path, edited if same else keep_unchanged_text(text, dump_config(want, header=note)))


class FallbackMixin:
    """The trainer's OOM handling. Expects the Trainer's state: plan, good_plan, plan_dirty, fallbacks, phase,
    step, step_rng, t, device, cuda, config_path, file_config, last_checkpoint, log, and its `_account`,
    `_checkpoint`, `_emit` and (FailureMixin's) `_forget_step` methods."""

    def _attempt(self, work: Callable[[list[Batch]], Any], phase: str, batches: list[Batch],
                 draw: Callable[[], list[Batch]]) -> tuple[Any, int]:
        """Draw `batches` once (a retry runs the very same ones), then run `work(batches)` under the device's
        memory accounting; on OOM fall back and retry. -> (result, peak bytes)."""
        while True:
            self.phase = phase
            oom = lone = None
            try:
                if not batches:
                    self.phase = "eval-data" if phase == "eval" else "data"  # eval's: after its step finished
                    # outside the accounting: host-side work (a corpus in RAM, tokenizing) is not device
                    # memory; what the batches themselves hold is counted on a simulated device
                    batches.extend(draw())
                    self._account(batches)
                with self.device.measure() as reading:
                    self.phase = phase
                    result = work(batches)
            except LoneOutOfMemory as e:
                lone = e
            except Exception as e:
                if not is_oom(e):
                    raise
                oom = first_line(e)
            if oom is not None and self.phase in ("data", "eval-data"):
                self._stop_in_data(oom, after_step=phase == "eval")
            if lone is not None:  # only this rank ran out, inside FSDP's collectives
                self._stop_for_relaunch(lone.message, writes=True)
            if oom is not None and self.plan.sharding == "fsdp" and self.dist is not None:
                # FSDP cannot resume a step it left half way (its units' state): start afresh from a checkpoint
                self._stop_for_relaunch(oom, writes=self.dist.is_main)
            if oom is None:
                self.good_plan = self.plan
                if self.plan_dirty:
                    self._save_plan()
                return result, reading.peak_bytes
            self._recover(oom)  # outside the except block: its frames no longer hold the failed step's tensors

    def _recover(self, message: str) -> None:
        phase = self.phase
        step = self.step if phase == "eval" else self.step + 1  # eval runs after its step is counted
        # rewind what the failed attempt drew (dropout), but not for eval: the retry runs as if it never had
        self._forget_step(rewind_rng=phase != "eval")
        if phase == "optimizer":
            last = f"; the last checkpoint is {self.last_checkpoint}" if self.last_checkpoint else ""
            self.log.event("oom_stop", step=step, phase=phase, message=message)
            raise OomtuneError(
                f"out of memory in the optimizer step at step {step} ({message}): the weights, gradients and "
                f"optimizer state alone do not fit, so a smaller micro-batch cannot help{last}", NO_FIT)
        new = smaller_plan(self.plan)
        if new is None:
            self.plan = self.good_plan  # a resume with more memory starts from the last plan that ran
            path = self._checkpoint("oom")  # the state of the last finished step: nothing of this one applied
            self.log.event("oom_stop", step=step, phase=phase, message=message)
            raise OomtuneError(
                f"out of memory at micro-batch 1 (step {step}, {phase}, context {self.plan.context_length}): "
                f"nothing smaller to fall back to. Saved {path} (step {self.step}); free memory or use a larger "
                "--budget, activation checkpointing or a shorter context, then rerun with --resume", NO_FIT)
        fallback = OomFallback(step, phase, self.plan, new, message)
        self.fallbacks.append(fallback)
        self.log.event("oom_fallback", step=step, phase=phase, message=message, old_plan=to_dict(self.plan),
                       new_plan=to_dict(new))
        self.plan = new
        self.plan_dirty = True
        self._emit(fallback)

    def _stop_in_data(self, message: str, after_step: bool) -> None:
        """Out of memory while the batches were drawn: a smaller micro-batch draws the same batches, and a retry
        would draw other ones (the stream moved on; a generator that raised is done), so stop, with the state of
        the last finished step saved (one process: with ranks, a checkpoint is a collective its peers are not in);
        `--resume` replays the stream to it."""
        step = self.step if after_step else self.step + 1
        self.device.release()
        self.log.event("oom_stop", step=step, phase="data", message=message)
        if self.dist is None:
            saved = f"Saved {self._checkpoint('oom')} (step {self.step})"
        else:
            saved = f"The last checkpoint is {self.last_checkpoint}" if self.last_checkpoint else "No checkpoint yet"
        raise OomtuneError(
            f"out of memory while drawing the {'eval ' if after_step else ''}batches of step {step} ({message}): "
            f"the batches alone do not fit, and a smaller micro-batch draws the same ones. {saved}; free memory or "
            "use a larger --budget, then rerun with --resume", NO_FIT)

    def _stop_for_relaunch(self, message: str, writes: bool) -> None:
        """FSDP ran out of memory (on every rank, or on this one alone): stop every rank, with the halved plan
        written into the config (by one rank: `writes`) so that `--resume` - or the launcher, which relaunches
        the ranks itself - continues from the last checkpoint with it."""
        step = self.step if self.phase == "eval" else self.step + 1
        new = smaller_plan(self.plan)
        last = f"; the last checkpoint is {self.last_checkpoint}" if self.last_checkpoint else ""
        if new is None:
            raise OomtuneError(f"out of memory at micro-batch 1 (step {step}, {self.phase}): nothing smaller to "
                               f"fall back to ({message}){last}", NO_FIT)
        if writes:
            note = (f"plan updated by `oomtune train` at step {step}: out of memory at micro-batch "
                    f"{self.plan.micro_batch_size} under fsdp, now {new.describe()}")
            rewrite_plan(self.config_path, self.file_config, new, note)
            self.log.event("oom_relaunch", always=True, step=step, phase=self.phase, message=message,
                           old_plan=to_dict(self.plan), new_plan=to_dict(new))
        raise OomtuneError(f"out of memory at step {step} ({message}); FSDP restarts from a checkpoint: "
                           f"{self.config_path} now says micro-batch {new.micro_batch_size} x{new.grad_accum_steps}, "
                           f"continue with --resume{last}", OOM_RELAUNCH)

    def _save_plan(self) -> None:
        """Write the plan that now works back into the config file (atomically), so the next run starts there."""
        self.plan_dirty = False
        step = self.fallbacks[-1].step
        note = (f"plan updated by `oomtune train` at step {step}: out of memory at micro-batch "
                f"{self.file_config.plan.micro_batch_size}, now {self.plan.describe()}")
        try:
            rewrite_plan(self.config_path, self.file_config, self.plan, note)
        except OSError as e:
            self._emit(Note(f"could not update {self.config_path} with the new plan: {e}", warning=True))
            return
        self.file_config = dataclasses.replace(self.file_config, plan=self.plan)
        self.log.event("config_updated", step=step, path=str(self.config_path), plan=to_dict(self.plan))
        self._emit(Note(f"updated {self.config_path}: plan is now {self.plan.describe()}"))


class NonFiniteLoss(Exception):
    """A training micro-batch's loss was NaN or infinite (on some rank): raised before the step's update."""

    def __init__(self, values: list[float]):
        super().__init__("non-finite training loss")
        self.values = values  # this rank's micro-batch losses of the step


class LossWatch:
    """Stands in for the model file inside the training step (`step.py` calls `t.model_file.loss`): keeps each
    training micro-batch's loss, detached and without a sync, for `FailureMixin._check_losses`."""

    def __init__(self, model_file: Any):
        self.model_file = model_file
        self.losses: list[torch.Tensor] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model_file, name)

    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        value = self.model_file.loss(model, batch)
        if torch.is_grad_enabled():  # a training micro-step; evaluation runs under no_grad
            self.losses.append(value.detach())
        return value


def _non_finite_buffer(module: torch.nn.Module) -> str | None:
    """The first floating-point buffer (BatchNorm running statistics, say) holding a NaN or an infinity."""
    for name, buf in module.named_buffers():
        if buf.is_floating_point() and not bool(torch.isfinite(buf).all()):
            return name
    return None


class FailureMixin:
    """The trainer's stops on a diverged loss and on an error mid-run. Expects the Trainer's state: watch, phase,
    step, start_step, resumed_from, run_dir, step_rng, checkpoint_step, last_checkpoint, t, device, cuda, dist, cfg,
    plan, log, and `_checkpoint`."""

    def _check_losses(self) -> None:
        """At a step's optimizer phase, before its update: stop on a NaN / infinite loss of any micro-batch. One
        sync point a step (and one all-reduce on several ranks, so that they all stop at the same step)."""
        losses, self.watch.losses = self.watch.losses, []
        if not losses:
            return
        values = torch.stack([v.float() for v in losses])
        bad = not bool(torch.isfinite(values).all())
        if self.dist is not None:
            bad = bool(self.dist.max(1.0 if bad else 0.0)[0])
        if bad:
            raise NonFiniteLoss(values.tolist())

    def _forget_step(self, rewind_rng: bool) -> None:
        """Drop what the step in flight did (half-accumulated gradients, its RNG draws): the state is then that of
        the last finished step, ready to be retried or checkpointed."""
        self.t.model.zero_grad(set_to_none=True)
        self.watch.losses = []
        self.device.release()
        if rewind_rng:
            restore_rng(self.step_rng, self.cuda)

    def _stop_diverged(self, e: NonFiniteLoss) -> NoReturn:
        step = self.step + 1
        self._forget_step(rewind_rng=True)  # the update of `step` never ran
        bad = [(i, v) for i, v in enumerate(e.values) if not math.isfinite(v)]
        if bad:
            where = f" (micro-batch {bad[0][0] + 1} of {len(e.values)})" if len(e.values) > 1 else ""
            what = f"the training loss is {bad[0][1]} at step {step}{where}"
        else:
            what = f"the training loss of another rank is not finite at step {step}"
        if self.step == self.start_step and self.resumed_from is not None:  # at once after the resume
            saved = (f"It is the first step after {self.resumed_from} (step {self.step}): either that state leads "
                     f"to it already, or the batch of step {step} does (a resume replays the same data)")
            hint = (f"resume with a lower --lr (now {self.cfg.lr:g}); if it persists, check that batch, or move "
                    f"{self.resumed_from.name} out of {self.run_dir} to resume from an older checkpoint")
        elif self.step == 0:
            saved = "No step had run, so nothing was saved"
            hint = ("check the model file's loss and data (a NaN before any update is not the learning rate)"
                    + ("; fp16 overflows above 65504: try bf16" if self.plan.precision == "fp16" else ""))
        else:
            tainted = _non_finite_buffer(self.t.module)  # running statistics the failed forwards already updated
            if self.dist is not None and bool(self.dist.max(0.0 if tainted is None else 1.0)[0]):
                tainted = tainted or "of another rank"  # all ranks save, or none: a checkpoint is collective
            if tainted is not None:
                saved = (f"The NaN already reached the model's buffer {tainted} in step {step}'s forward, so step "
                         f"{self.step} was not saved; the last checkpoint is "
                         f"{self.last_checkpoint or 'none'}" + (f" (step {self.checkpoint_step})"
                                                                  if self.last_checkpoint else ""))
            else:
                saved = None
                if self.checkpoint_step != self.step:
                    try:
                        self._checkpoint("diverged", keep=KEEP + 1)  # keeps the earlier ones: this may be bad already
                    except OomtuneError as w:  # a full disk: say both
                        saved = f"Step {self.step} could not be saved ({w.message})"
                saved = saved or f"The last finite step is saved in {self.last_checkpoint} (step {self.step})"
            hints = [f"lower --lr (now {self.cfg.lr:g})"]
            if self.cfg.clip_grad_norm is None:
                hints.append("enable clipping (--clip-grad-norm 1.0)")
            if self.plan.precision == "fp16":
                hints.append("use bf16 where the device has it (fp16 overflows above 65504)")
            hint = ", ".join(hints) + (", then continue with --resume (should that step be too far gone already, "
                                       "with an older checkpoint or another --run-dir)")
        self.log.event("diverged", step=step, loss=str(bad[0][1]) if bad else None,
                       checkpoint=self.last_checkpoint.name if self.step and self.last_checkpoint else None)
        raise OomtuneError(f"{what}: training diverged and stopped before applying that step. {saved}; {hint}",
                           NO_FIT)

    def _stop_on_error(self, e: Exception) -> NoReturn:
        """An error mid-run that is not one of the trainer's own stops (a model-file hook raising, eval_batches
        yielding nothing): save the last finished step when it is newer than the last checkpoint (one process; not
        when the error came inside the optimizer update, which may be half applied), log it, re-raise as one line."""
        if isinstance(e, OomtuneError) and not isinstance(e, ModelFileError):
            raise e  # already one line and its own stop (out of memory, a checkpoint write, a log write)
        phase = getattr(self, "phase", "data")
        done = phase in ("eval", "eval-data", "after")  # the step had finished
        step = self.step if done else self.step + 1
        message = e.message if isinstance(e, OomtuneError) else f"{type(e).__name__}: {first_line(e, '(no message)')}"
        saved = failed = None
        if (self.dist is None and phase not in ("optimizer", "checkpoint") and self.step > 0
                and self.checkpoint_step != self.step):
            self._forget_step(rewind_rng=not done)
            try:
                saved = self._checkpoint("error")
            except OomtuneError as w:
                failed = w.message
        try:
            self.log.event("error", step=step, phase=phase, message=message,
                           checkpoint=self.last_checkpoint.name if self.last_checkpoint else None)
        except OomtuneError:
            pass  # the run dir cannot be written: the error itself says more
        if self.dist is not None or (self.step == 0 and self.last_checkpoint is None):
            raise e  # several ranks: the CLI tells a peer's failure from this rank's own by the error itself
        if saved is not None:
            tail = f"Saved {saved} (step {self.step}, the last finished one): fix it, then continue with --resume"
        elif self.last_checkpoint is not None:
            tail = (f"The last checkpoint is {self.last_checkpoint} (step {self.checkpoint_step}): continue with "
                    "--resume")
        else:
            tail = "No checkpoint could be saved" + (f" ({failed})" if failed else " (the error came in the "
                                                     "optimizer update)")
        if isinstance(e, ModelFileError):
            raise ModelFileError(f"{message} (at step {step}). {tail}") from e
        raise OomtuneError(f"{message} (at step {step}, {phase}; rerun with --debug for the traceback). {tail}",
                           NO_FIT) from e
