"""How `oomtune train` survives or stops: the out-of-memory fallback, a diverged (NaN / infinite) loss, an error
mid-run. `RecoveryPolicy` reads the run's state and returns a decision (`Retry` or `Stop`); the trainer carries it
out. The policy changes nothing itself.

An OOM in a step (a longer real batch, fragmentation) is caught; outside the `except` block the step in flight is
forgotten (gradients dropped, memory given back, its RNG draws rewound), the micro-batch halved and the
accumulation doubled (the global batch stays exact), and the same batches retried (`Retry`). Once the smaller plan
has run, the config file is rewritten with it (only the plan's numbers are edited, so a person's comments survive).
Where nothing smaller exists, where only the optimizer state is too big, where the batches themselves do not fit,
or under FSDP (a step left half way cannot be retried in place), the run stops (`Stop`), with the state of the
last finished step saved where that can be done.

A diverged loss stops before that step's update with a checkpoint of the last finished step (losses.py). An error
mid-run (a model-file hook raising, eval_batches yielding nothing) saves the last finished step too, when it is
newer than the last checkpoint, so that `--resume` continues once the problem is fixed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.schema import Plan, TrainConfig
from ..config.writing import NotRewritten, rewrite_plan, to_dict
from ..errors import BAD_INPUT, NO_FIT, OOM_RELAUNCH, ModelFileError, OomtuneError, first_line
from .checkpoint import KEEP
from .events import OomFallback
from .state import Phase, RunState


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


@dataclass(frozen=True)
class Retry:
    """Fall back: forget the step in flight and run the same batches again with `plan`."""

    plan: Plan
    fallback: OomFallback
    rewind_rng: bool  # the retry draws what the failed attempt drew (not for eval: it runs as if it never had)


@dataclass(frozen=True)
class Stop:
    """End the run: the trainer forgets the step in flight if asked, saves the last finished step if asked, writes
    the relaunch plan if any, logs `event`, then raises `error` (or `line` as an OomtuneError of `exit_code`)."""

    line: str = ""  # the one line, once `save` (if any) has succeeded
    exit_code: int = NO_FIT
    event: str | None = None  # the events.jsonl kind logged before stopping
    fields: dict[str, Any] = field(default_factory=dict)
    name_checkpoint: bool = False  # the event names the last checkpoint (after the save)
    forget_step: bool = False  # drop the step in flight (gradients, losses, memory)
    rewind_rng: bool = False  # ... and its RNG draws (it never finished)
    restore_plan: Plan | None = None  # the plan to record (a resume with more memory starts from the last that ran)
    save: str | None = None  # checkpoint the last finished step first, for this reason
    keep: int = KEEP
    if_save_fails: str | None = None  # the line when that save fails: `{error}` is why
    relaunch_plan: Plan | None = None  # written into the config for the launcher (by the rank that `writes`)
    relaunch_note: str = ""
    writes: bool = False
    error_type: type[OomtuneError] = OomtuneError
    cause: BaseException | None = None
    reraise: BaseException | None = None  # raise this instead (already one line, or a peer's failure to tell)


def checkpoint_named(state: RunState, what: str = "the last checkpoint is") -> str:
    """'; the last checkpoint is X' when there is one, else nothing."""
    return f"; {what} {state.last_checkpoint}" if state.last_checkpoint else ""


class RecoveryPolicy:
    """Decides what an out-of-memory error, a diverged loss or an error mid-run does to a run.

    `collective`: a checkpoint needs every rank (a process group), so a rank that stops alone saves none;
    `main`: this rank writes the config; `fsdp`: the plan is sharded over a process group (an FSDP step left half way
    cannot be retried: every rank stops and the launcher relaunches them)."""

    def __init__(self, config_path: Path, cfg: TrainConfig, *, collective: bool, main: bool, fsdp: bool,
                 resumed_from: Path | None, run_dir: Path):
        self.config_path = config_path
        self.cfg = cfg
        self.collective = collective
        self.main = main
        self.fsdp = fsdp
        self.resumed_from = resumed_from
        self.run_dir = run_dir

    # -- out of memory ------------------------------------------------------------------------------
    def after_oom(self, state: RunState, message: str, lone: bool = False) -> Retry | Stop:
        """`lone`: only this rank ran out, inside FSDP's collectives (no agreement was possible)."""
        phase, step = state.phase, state.failing_step
        if phase in (Phase.DATA, Phase.EVAL_DATA):
            return self._oom_in_data(state, message)
        if lone or self.fsdp:
            return self._relaunch(state, message, writes=lone or self.main)
        oom_stop = {"step": step, "phase": phase.value, "message": message}
        in_backward = state.plan.optimizer_in_backward  # (no accumulation: no smaller micro-batch keeps the batch)
        if phase is Phase.OPTIMIZER:  # (under optimizer_in_backward: the backward that applies the update, partly)
            why = ("backward applies the update under plan.optimizer_in_backward, and may have applied part of it"
                   if in_backward else "the weights, gradients and optimizer state alone do not fit, so a smaller "
                   "micro-batch cannot help")
            return Stop(f"out of memory in the optimizer step at step {step} ({message}): {why}"
                        + checkpoint_named(state), event="oom_stop", fields=oom_stop, forget_step=True,
                        rewind_rng=True)
        new = None if in_backward else smaller_plan(state.plan)
        rewind = phase is not Phase.EVAL  # the eval retry runs as if the failed attempt never had
        if new is None:
            what = (f"micro-batch {state.plan.micro_batch_size} under plan.optimizer_in_backward, which cannot "
                    "accumulate smaller ones" if in_backward else "micro-batch 1")
            return Stop(f"out of memory at {what} (step {step}, {phase.value}, context "
                        f"{state.good_plan.context_length}): nothing smaller to fall back to. Saved "
                        f"{{checkpoint}} (step {state.step}); free memory or use a larger --budget, activation "
                        "checkpointing or a shorter context, then rerun with --resume", event="oom_stop",
                        fields=oom_stop, forget_step=True, rewind_rng=rewind, restore_plan=state.good_plan,
                        save="oom")
        return Retry(new, OomFallback(step, phase.value, state.plan, new, message), rewind)

    def _oom_in_data(self, state: RunState, message: str) -> Stop:
        """A smaller micro-batch draws the same batches, and a retry would draw other ones (the stream moved on; a
        generator that raised is done), so stop, with the state of the last finished step saved (one process: with
        ranks, a checkpoint is a collective its peers are not in); `--resume` replays the stream to it."""
        after_step = state.phase is Phase.EVAL_DATA
        step = state.failing_step
        if not self.collective:
            saved, save = f"Saved {{checkpoint}} (step {state.step})", "oom"
        else:
            saved = f"The last checkpoint is {state.last_checkpoint}" if state.last_checkpoint else "No checkpoint yet"
            save = None
        return Stop(f"out of memory while drawing the {'eval ' if after_step else ''}batches of step {step} "
                    f"({message}): the batches alone do not fit, and a smaller micro-batch draws the same ones. "
                    f"{saved}; free memory or use a larger --budget, then rerun with --resume", event="oom_stop",
                    fields={"step": step, "phase": "data", "message": message}, save=save)

    def _relaunch(self, state: RunState, message: str, writes: bool) -> Stop:
        """FSDP ran out of memory (on every rank, or on this one alone): stop every rank, with the halved plan written
        into the config (by one rank: `writes`) so that `--resume` - or the launcher, which relaunches the ranks
        itself - continues from the last checkpoint with it."""
        step, phase = state.failing_step, state.phase.value
        new = smaller_plan(state.plan)
        if new is None:
            return Stop(f"out of memory at micro-batch 1 (step {step}, {phase}): nothing smaller to fall back to "
                        f"({message}){checkpoint_named(state)}")
        note = (f"plan updated by `oomtune train` at step {step}: out of memory at micro-batch "
                f"{state.plan.micro_batch_size} under fsdp, now {new.describe()}")
        return Stop(f"out of memory at step {step} ({message}); FSDP restarts from a checkpoint: {self.config_path} "
                    f"now says micro-batch {new.micro_batch_size} x{new.grad_accum_steps}, continue with --resume"
                    + checkpoint_named(state), OOM_RELAUNCH, event="oom_relaunch" if writes else None,
                    fields={"step": step, "phase": phase, "message": message, "old_plan": to_dict(state.plan),
                            "new_plan": to_dict(new)}, relaunch_plan=new, relaunch_note=note, writes=writes)

    # -- a diverged loss ------------------------------------------------------------------------------
    def after_divergence(self, state: RunState, values: list[float], tainted: str | None) -> Stop:
        """A non-finite loss in the step in flight (`values`: this rank's micro-batch losses); `tainted`: a buffer
        of the model the failed forwards already made non-finite (on some rank), so the last step is not clean."""
        step = state.step + 1
        bad = [(i, v) for i, v in enumerate(values) if not math.isfinite(v)]
        if bad:
            where = f" (micro-batch {bad[0][0] + 1} of {len(values)})" if len(values) > 1 else ""
            what = f"the training loss is {bad[0][1]} at step {step}{where}"
        else:
            what = f"the training loss of another rank is not finite at step {step}"
        save, failed = None, None
        if state.step == state.start_step and self.resumed_from is not None:  # at once after the resume
            saved = (f"It is the first step after {self.resumed_from} (step {state.step}): either that state leads "
                     f"to it already, or the batch of step {step} does (a resume replays the same data)")
            hint = (f"resume with a lower --lr (now {self.cfg.lr:g}); if it persists, check that batch, or move "
                    f"{self.resumed_from.name} out of {self.run_dir} to resume from an older checkpoint")
        elif state.step == 0:
            saved = "No step had run, so nothing was saved"
            hint = ("check the model file's loss and data (a NaN before any update is not the learning rate)"
                    + ("; fp16 overflows above 65504: try bf16" if state.plan.precision == "fp16" else ""))
        else:
            if tainted is not None:
                last = f" (step {state.checkpoint_step})" if state.last_checkpoint else ""
                saved = (f"The NaN already reached the model's buffer {tainted} in step {step}'s forward, so step "
                         f"{state.step} was not saved; the last checkpoint is {state.last_checkpoint or 'none'}{last}")
            else:
                saved = f"The last finite step is saved in {{checkpoint}} (step {state.step})"
                save = None if state.saved_now else "diverged"
                failed = f"Step {state.step} could not be saved ({{error}})"
            hint = self._divergence_hints(state.plan)
        line = f"{what}: training diverged and stopped before applying that step. {{saved}}; {hint}"
        return Stop(line.replace("{saved}", saved), event="diverged",
                    fields={"step": step, "loss": str(bad[0][1]) if bad else None}, name_checkpoint=state.step > 0,
                    forget_step=True, rewind_rng=True, save=save, keep=KEEP + 1,  # this one may be bad already
                    if_save_fails=line.replace("{saved}", failed) if failed else None)

    def _divergence_hints(self, plan: Plan) -> str:
        hints = [f"lower --lr (now {self.cfg.lr:g})"]
        if self.cfg.clip_grad_norm is None:
            hints.append("enable clipping (--clip-grad-norm 1.0)")
        if plan.precision == "fp16":
            hints.append("use bf16 where the device has it (fp16 overflows above 65504)")
        return ", ".join(hints) + (", then continue with --resume (should that step be too far gone already, with "
                                   "an older checkpoint or another --run-dir)")

    # -- an error mid-run -----------------------------------------------------------------------------
    def after_error(self, state: RunState, e: Exception) -> Stop:
        """An error that is not one of the trainer's own stops (a model-file hook raising, eval_batches yielding
        nothing): save the last finished step when it is newer than the last checkpoint (one process; not when the
        error came inside the optimizer update, which may be half applied), log it, stop with one line."""
        if isinstance(e, OomtuneError) and not isinstance(e, ModelFileError):
            return Stop(reraise=e)  # already one line and its own stop (out of memory, a checkpoint write, a log)
        phase, step = state.phase, state.failing_step
        message = e.message if isinstance(e, OomtuneError) else f"{type(e).__name__}: {first_line(e, '(no message)')}"
        event = {"event": "error", "fields": {"step": step, "phase": phase.value, "message": message},
                 "name_checkpoint": True}
        if self.collective or (state.step == 0 and state.last_checkpoint is None):
            return Stop(reraise=e, **event)  # ranks: the CLI tells a peer's failure from this rank's own by the error
        saves = phase not in (Phase.OPTIMIZER, Phase.CHECKPOINT) and state.step > 0 and not state.saved_now
        older = (f"The last checkpoint is {state.last_checkpoint} (step {state.checkpoint_step}): continue with "
                 "--resume") if state.last_checkpoint is not None else None
        if saves:
            tail = f"Saved {{checkpoint}} (step {state.step}, the last finished one): fix it, then continue with " \
                   "--resume"
        else:
            tail = older or "No checkpoint could be saved (the error came in the optimizer update)"
        kind: type[OomtuneError] = ModelFileError if isinstance(e, ModelFileError) else OomtuneError
        head = (f"{message} (at step {step})." if kind is ModelFileError
                else f"{message} (at step {step}, {phase.value}; rerun with --debug for the traceback).")
        return Stop(f"{head} {tail}", NO_FIT if kind is OomtuneError else BAD_INPUT, **event,
                    forget_step=saves, rewind_rng=saves and not phase.step_done, save="error" if saves else None,
                    if_save_fails=f"{head} {older or 'No checkpoint could be saved ({error})'}", error_type=kind,
                    cause=e)


def write_relaunch_plan(config_path: Path, started: Plan, stop: Stop, line: str) -> tuple[str, int]:
    """Write a relaunch stop's plan into the config for the launcher -> the stop's line and exit code; where the
    config on disk no longer holds the plan this run started from (nothing written), no relaunch: it would run the
    plan that ran out of memory again."""
    try:
        rewrite_plan(config_path, started, stop.relaunch_plan, stop.relaunch_note)
    except NotRewritten as e:
        return f"{line} No relaunch: {e}; continue with --resume once the plan is smaller.", NO_FIT
    return line, stop.exit_code
