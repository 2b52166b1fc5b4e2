"""`oomtune train`: the training loop around `step.train_step`, the same step the probe measured.

One optimizer step draws `global_batch / data_batch` batches from the data stream, cuts each into
micro-batches of the current plan and hands them to `train_step`. An out-of-memory error in a step (a
longer real batch, fragmentation) is caught; outside the `except` block the gradients are dropped and
memory given back, the micro-batch is halved and the accumulation doubled (the global batch stays exact),
and the same batches are retried. The config file is rewritten with the plan that worked.

Exact resume: a checkpoint holds the model, optimizer, scaler, step and the global RNG states. The data
come from a private RNG stream (seed + 1) that is swapped in around every draw, so the model's randomness
(dropout) and the data's never interleave; resuming replays the data stream to its position
(step x batches per step) and restores the global RNGs, so a resumed run computes what an uninterrupted
run would have, bit for bit on the same machine.

Library code: it reports through `on_event` callbacks and returns a TrainResult; it never prints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import json
import math
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from .checkpoint import (
    capture_rng,
    latest_checkpoint,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
    seed_everything,
    stale_temp_files,
)
from .data import DataStream, split_batch
from .devices import Device, is_oom, make_device
from .errors import BAD_INPUT, NO_FIT, ConfigError, ModelFileError, OomtuneError
from .model_file import Batch, load_model_file
from .plan import Config, Plan, TrainConfig, atomic_write, dump_config, from_dict, load_config, to_dict
from .step import Training, build_training, eval_loss, train_step

METRICS = "metrics.jsonl"  # one JSON object per logged step: step, loss, lr, tokens_per_s, peak_bytes[, eval_loss]
EVENTS = "events.jsonl"  # start / resume / oom_fallback / config_updated / checkpoint / interrupted / finished
DATA_SEED_OFFSET, EVAL_SEED_OFFSET = 1, 2  # the data and eval streams' seeds, relative to train.seed


# -- events: what the CLI renders ---------------------------------------------------------------------

@dataclass(frozen=True)
class Started:
    plan: Plan
    train: TrainConfig
    start_step: int  # 0, or the checkpoint's step when resuming
    device: str
    run_dir: Path
    data: str  # "train_batches" (real data) or "make_batch" (synthetic)
    evaluates: bool
    resumed_from: Path | None = None


@dataclass(frozen=True)
class Note:
    message: str
    warning: bool = False


@dataclass(frozen=True)
class StepDone:
    step: int
    steps: int
    metrics: dict | None  # the metrics.jsonl line when this step was logged, else None


@dataclass(frozen=True)
class OomFallback:
    step: int  # the step that ran out of memory (it is retried)
    phase: str  # data | forward | backward | eval
    old_plan: Plan
    new_plan: Plan
    message: str  # the allocator's (or the simulated device's) first line


@dataclass(frozen=True)
class Checkpointed:
    step: int
    path: Path
    reason: str  # interval | final | interrupted | oom


Event = Started | Note | StepDone | OomFallback | Checkpointed


@dataclass(frozen=True)
class TrainResult:
    step: int  # optimizer steps done in total (the last checkpoint's step when interrupted)
    steps: int  # train.steps
    plan: Plan  # the plan training ended with (smaller than the config's after an OOM fallback)
    interrupted: bool
    run_dir: Path
    checkpoint: Path | None
    first_loss: float | None  # of this invocation's first logged step
    last_loss: float | None
    eval_loss: float | None  # the last evaluation's
    fallbacks: tuple[OomFallback, ...] = ()
    seconds: float = 0.0


# -- pure pieces ----------------------------------------------------------------------------------------

def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup to cfg.lr over warmup_steps, then
    cosine decay to min_lr at cfg.steps (nanoGPT's schedule)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def smaller_plan(plan: Plan) -> Plan | None:
    """After an OOM: the largest micro-batch that divides the current one and is at most half of it, with
    the accumulation raised so the global batch is unchanged (8 x 2 -> 4 x 4; 6 -> 3 x 2; 5 -> 1 x 5).
    None at micro-batch 1."""
    m = plan.micro_batch_size
    smaller = next((d for d in range(m // 2, 0, -1) if m % d == 0), None)
    if smaller is None:
        return None
    return dataclasses.replace(plan, micro_batch_size=smaller,
                               grad_accum_steps=plan.global_batch_size // smaller)


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
        same = from_dict(Config, yaml.safe_load(edited)) == want
    except (ConfigError, yaml.YAMLError):
        same = False
    atomic_write(path, edited if same else dump_config(want, header=note))


def resolve_device(config: Config, kind: str | None, budget: str | None) -> Device:
    """Train where the probe ran unless told otherwise; on the simulated cpu device also in the budget it
    probed (the memory the plan was found for). On cuda the default budget is the card's free memory."""
    found = config.found_by
    if kind is None and found is not None and found.device in ("cuda", "cpu"):
        kind = found.device
        if kind == "cuda" and not torch.cuda.is_available():
            raise OomtuneError(f"the config was probed on cuda ({found.gpu_name}) but PyTorch sees no GPU here; "
                               "pass --device cpu to train on the CPU")
    kind = kind or "auto"
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind not in ("cuda", "cpu"):
        raise OomtuneError(f"--device {kind}: training needs a device that computes (cuda or cpu)")
    if budget is None and kind == "cpu" and found is not None and found.device == "cpu":
        budget = str(found.budget_bytes)
    return make_device(kind, budget)


# -- Ctrl-C ----------------------------------------------------------------------------------------------

class StopRequest:
    signal_name: str | None = None


@contextlib.contextmanager
def graceful_stop() -> Iterator[StopRequest]:
    """SIGINT / SIGTERM ask the loop to stop after the step in flight and save a checkpoint; a second one
    stops at once (KeyboardInterrupt; the last checkpoint on disk stays whole). Main thread only."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handler(signum, frame):
        if request.signal_name is not None:
            raise KeyboardInterrupt
        request.signal_name = signal.Signals(signum).name

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield request
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


# -- the run ---------------------------------------------------------------------------------------------

def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat()


def _nvml_used_bytes(device: Device) -> int | None:
    """This process's memory on the GPU as nvidia-smi shows it (NVML), else the whole GPU's used memory
    (inside a container NVML's pids may not match ours); None without NVML."""
    from . import nvml

    props = torch.cuda.get_device_properties(device.torch_device)
    pci = None
    if all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        pci = (props.pci_domain_id, props.pci_bus_id, props.pci_device_id)
    uuid = str(props.uuid) if getattr(props, "uuid", None) is not None else None
    gpu = nvml.find_gpu(nvml.query(processes=True), pci=pci, uuid=uuid)
    if gpu is None:
        return None
    mine = next((p.used_bytes for p in gpu.processes if p.pid == os.getpid() and p.used_bytes is not None), None)
    return mine if mine is not None else gpu.used_bytes


class Trainer:
    """One invocation of `oomtune train`. Build it (every check that can fail on bad input runs here, before
    any file is written), then `run()`."""

    def __init__(self, config_path: str | Path, *, overrides: dict[str, Any] | None = None,
                 device: str | None = None, budget: str | None = None, resume: bool = False,
                 on_event: Callable[[Event], None] | None = None):
        self.config_path = Path(config_path)
        self.file_config = load_config(self.config_path)  # as on disk: what an OOM fallback rewrites
        given = {k: v for k, v in (overrides or {}).items() if v is not None}
        try:
            self.cfg = dataclasses.replace(self.file_config.train, **given)
        except ConfigError as e:  # the dataclass validates: defaults and rules live there only
            raise ConfigError(e.message.replace("train.", "--").replace("_", "-")) from None
        model_path = self.file_config.model_path(self.config_path)
        try:
            self.model_file = load_model_file(model_path)
        except ModelFileError as e:
            raise ModelFileError(f"{self.config_path}: {e.message}") from None
        self.on_event = on_event or (lambda event: None)
        self.run_dir = Path(self.cfg.run_dir)
        self.resume_state: dict | None = None
        self.resumed_from: Path | None = None
        if resume:
            latest = latest_checkpoint(self.run_dir)
            if latest is None:
                raise OomtuneError(f"--resume: no checkpoint (ckpt-*.pt) in run dir {self.run_dir}", BAD_INPUT)
            self.resume_state = load_checkpoint(latest)
            self.resumed_from = latest
            plan = self._checkpoint_plan(latest)
        else:
            taken = [p for p in (self.run_dir / METRICS, latest_checkpoint(self.run_dir)) if p and p.exists()]
            if taken:
                raise OomtuneError(f"run dir {self.run_dir} already holds a run ({taken[0].name}): pass --resume "
                                   "to continue it, or --run-dir for a new one", BAD_INPUT)
            plan = self.file_config.plan
        self.plan = plan
        self.data_batch = (self.resume_state["data"]["batch_size"] if self.resume_state
                           else plan.micro_batch_size)  # the size batches are drawn at; cut to the plan's
        self.device = resolve_device(self.file_config, device, budget)
        self.cuda = self.device.torch_device.type == "cuda"

    def _checkpoint_plan(self, path: Path) -> Plan:
        st = self.resume_state
        assert st is not None
        try:
            plan = Plan(**st["plan"])
            batch = int(st["data"]["batch_size"])
            step = int(st["step"])
        except (TypeError, KeyError, ValueError, ConfigError) as e:
            raise OomtuneError(f"checkpoint {path} has an unreadable plan or data position ({_one_line(e)})",
                               BAD_INPUT) from None
        if batch % plan.micro_batch_size or plan.global_batch_size % batch or step < 0:
            raise OomtuneError(f"checkpoint {path}: data batch {batch} does not fit plan {plan.describe()}",
                               BAD_INPUT)
        return plan

    # -- small helpers -------------------------------------------------------------------------------
    def _emit(self, event: Event) -> None:
        self.on_event(event)

    def _log_event(self, kind: str, **fields) -> None:
        with open(self.run_dir / EVENTS, "a") as f:
            f.write(json.dumps({"time": _now(), "event": kind, **fields}) + "\n")

    def _set_phase(self, phase: str) -> None:
        self.phase = phase

    @property
    def batches_per_step(self) -> int:
        return self.plan.global_batch_size // self.data_batch

    def _micro_batches(self, batches: list[Batch]) -> list[Batch]:
        parts = self.data_batch // self.plan.micro_batch_size
        label = f"{self.model_file.label}: {self.data_hook}()"
        return [piece for b in batches for piece in split_batch(b, self.data_batch, parts, label)]

    def _checkpoint(self, reason: str) -> Path:
        t = self.t
        state = {
            "step": self.step, "plan": to_dict(self.plan),
            "data": {"batch_size": self.data_batch, "batches": self.step * self.batches_per_step,
                     "hook": self.data_hook},
            "model": t.model.state_dict(), "optimizer": t.optimizer.state_dict(), "scaler": t.scaler.state_dict(),
            "rng": capture_rng(self.cuda), "train": to_dict(self.cfg), "model_file": str(self.model_file.path),
            "torch_version": str(torch.__version__),
        }
        path = save_checkpoint(self.run_dir, state)
        self.last_checkpoint, self.checkpoint_step = path, self.step
        self._log_event("checkpoint", step=self.step, path=path.name, reason=reason)
        self._emit(Checkpointed(self.step, path, reason))
        return path

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
        self._log_event("config_updated", step=step, path=str(self.config_path), plan=to_dict(self.plan))
        self._emit(Note(f"updated {self.config_path}: plan is now {self.plan.describe()}"))

    # -- one unit of device work, with the OOM fallback ----------------------------------------------
    def _attempt(self, work: Callable[[list[Batch]], Any], phase: str, batches: list[Batch],
                 draw: Callable[[], list[Batch]]) -> tuple[Any, int]:
        """Draw `batches` once (a retry runs the very same ones), then run `work(batches)` under the device's
        memory accounting; on OOM fall back and retry. -> (result, peak bytes)."""
        while True:
            self.phase = phase
            oom = None
            try:
                if not batches:
                    self.phase = "data"
                    # outside the accounting: host-side work (a corpus in RAM, tokenizing) is not device
                    # memory; what the batches themselves hold is counted on a simulated device
                    batches.extend(draw())
                    self._account(batches)
                with self.device.measure() as reading:
                    self.phase = phase
                    result = work(batches)
            except Exception as e:
                if not is_oom(e):
                    raise
                oom = _one_line(e)
            if oom is None:
                self.good_plan = self.plan
                if self.plan_dirty:
                    self._save_plan()
                return result, reading.peak_bytes
            self._recover(oom)  # outside the except block: its frames no longer hold the failed step's tensors

    def _recover(self, message: str) -> None:
        phase = self.phase
        step = self.step if phase == "eval" else self.step + 1  # eval runs after its step is counted
        self.t.model.zero_grad(set_to_none=True)  # half-accumulated gradients of the failed step
        self.device.release()
        if phase != "eval":  # rewind what the failed attempt drew (dropout): the retry runs as if it never had
            restore_rng(self.step_rng, self.cuda)
        if phase == "optimizer":
            last = f"; the last checkpoint is {self.last_checkpoint}" if self.last_checkpoint else ""
            self._log_event("oom_stop", step=step, phase=phase, message=message)
            raise OomtuneError(
                f"out of memory in the optimizer step at step {step} ({message}): the weights, gradients and "
                f"optimizer state alone do not fit, so a smaller micro-batch cannot help{last}", NO_FIT)
        new = smaller_plan(self.plan)
        if new is None:
            self.plan = self.good_plan  # a resume with more memory starts from the last plan that ran
            path = self._checkpoint("oom")  # the state of the last finished step: nothing of this one applied
            self._log_event("oom_stop", step=step, phase=phase, message=message)
            raise OomtuneError(
                f"out of memory at micro-batch 1 (step {step}, {phase}, context {self.plan.context_length}): "
                f"nothing smaller to fall back to. Saved {path} (step {self.step}); free memory or use a larger "
                "--budget, activation checkpointing or a shorter context, then rerun with --resume", NO_FIT)
        fallback = OomFallback(step, phase, self.plan, new, message)
        self.fallbacks.append(fallback)
        self._log_event("oom_fallback", step=step, phase=phase, message=message, old_plan=to_dict(self.plan),
                        new_plan=to_dict(new))
        self.plan = new
        self.plan_dirty = True
        self._emit(fallback)

    # -- evaluation ----------------------------------------------------------------------------------
    def _evaluate(self) -> tuple[float, int]:
        def draw() -> list[Batch]:
            stream = DataStream(self.model_file, "eval_batches", self.data_batch, self.plan.context_length,
                                self.device, self.cfg.seed + EVAL_SEED_OFFSET)  # the same batches every time
            return [stream.next() for _ in range(self.cfg.eval_steps)]

        loss, peak = self._attempt(lambda batches: eval_loss(self.t, self._micro_batches(batches)), "eval", [],
                                   draw)
        value = float(loss)
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
        self.notes: list[Note] = []  # said once training has started

        # build and load first: a checkpoint that does not fit the model is bad input, and bad input writes nothing
        seed_everything(cfg.seed, self.cuda)
        self.t = self._build()
        base_lrs = [g["lr"] / cfg.lr for g in self.t.optimizer.param_groups]  # the optimizer hook's per-group ratio
        if self.resume_state:
            self._restore(self.resume_state)
            self.resume_state = None  # free the loaded copy

        self.run_dir.mkdir(parents=True, exist_ok=True)
        for tmp in stale_temp_files(self.run_dir):  # a write that was killed: never a checkpoint
            tmp.unlink(missing_ok=True)
        self._truncate_metrics()
        self._log_event("resume" if self.resumed_from else "start", step=self.step, plan=to_dict(self.plan),
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
        if self.resumed_from is not None:
            if self.step >= cfg.steps:
                self._emit(Note(f"the checkpoint is at step {self.step} and train.steps is {cfg.steps}: nothing "
                                "to do (raise --steps to train longer)"))
            else:
                stream.skip(self.step * self.batches_per_step)  # replay the data stream to where it stood

        first_loss = last_loss = last_eval = None
        tokens = 0
        seconds = 0.0
        peak = 0
        with graceful_stop() as stop:
            while self.step < cfg.steps and stop.signal_name is None:
                self.step_rng = capture_rng(self.cuda)
                lr = lr_at(self.step, cfg)
                for group, ratio in zip(self.t.optimizer.param_groups, base_lrs, strict=True):
                    group["lr"] = lr * ratio
                tic = time.perf_counter()
                loss, step_peak = self._attempt(
                    lambda batches: train_step(self.t, self._micro_batches(batches)), "forward", [],
                    functools.partial(stream.take, self.batches_per_step))
                seconds += time.perf_counter() - tic  # synchronized: measure() waits for the device
                self.step += 1
                tokens += self.plan.tokens_per_step
                peak = max(peak, step_peak)

                eval_now = evaluates and (self.step % cfg.eval_interval == 0 or self.step == cfg.steps)
                metrics = None
                if (self.step % cfg.log_every_n_steps == 0 or self.step in (1, cfg.steps) or eval_now
                        or stop.signal_name is not None):  # step 1: the starting loss, ln(vocab) for a fresh LM
                    last_loss = float(loss)  # a sync point, once per logged step
                    first_loss = last_loss if first_loss is None else first_loss
                    metrics = {"step": self.step, "loss": last_loss, "lr": lr,
                               "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
                               "peak_bytes": peak}
                    if self.cuda:
                        metrics["nvml_used_bytes"] = self._nvml()
                    if eval_now:
                        last_eval, eval_peak = self._evaluate()
                        metrics["eval_loss"] = last_eval
                        metrics["peak_bytes"] = max(peak, eval_peak)
                    metrics["micro_batch_size"] = self.plan.micro_batch_size  # changes after an OOM fallback
                    metrics["grad_accum_steps"] = self.plan.grad_accum_steps
                    self._write_metrics(metrics)
                    tokens, seconds, peak = 0, 0.0, 0
                self._emit(StepDone(self.step, cfg.steps, metrics))
                if self.step % cfg.checkpoint_interval == 0 or self.step == cfg.steps:
                    self._checkpoint("final" if self.step == cfg.steps else "interval")
            interrupted = stop.signal_name is not None and self.step < cfg.steps
            if interrupted:
                self._emit(Note(f"{stop.signal_name}: stopped after step {self.step}"))
                if self.checkpoint_step != self.step:
                    self._checkpoint("interrupted")
                self._log_event("interrupted", step=self.step, signal=stop.signal_name)
        if not interrupted:
            self._log_event("finished", step=self.step)
        return TrainResult(self.step, cfg.steps, self.plan, interrupted, self.run_dir, self.last_checkpoint,
                           first_loss, last_loss, last_eval, tuple(self.fallbacks), time.perf_counter() - started)

    def _account(self, *objs) -> None:
        """Count tensors made outside `measure()` on a simulated device (a no-op on cuda: the allocator sees
        everything)."""
        tracker = getattr(self.device, "tracker", None)
        if tracker is not None:
            tracker.track(*objs)

    def _build(self) -> Training:
        def work():
            return build_training(self.model_file, self.plan, self.device, lr=self.cfg.lr,
                                  clip_grad_norm=self.cfg.clip_grad_norm, weight_decay=self.cfg.weight_decay)

        oom = None
        try:
            with self.device.measure():
                t = work()
        except Exception as e:
            if not is_oom(e):
                raise
            oom = _one_line(e)
        if oom is not None:
            self.device.release()
            raise OomtuneError(f"out of memory building the model on {self.device.name}: {oom}", NO_FIT)
        t.on_phase = self._set_phase
        return t

    def _restore(self, st: dict) -> None:
        t, path = self.t, self.resumed_from
        try:
            with self.device.measure():
                t.model.load_state_dict(st["model"])
                t.optimizer.load_state_dict(st["optimizer"])
                t.scaler.load_state_dict(st["scaler"])
        except (RuntimeError, KeyError, ValueError, TypeError) as e:
            if is_oom(e):
                raise
            raise OomtuneError(f"checkpoint {path} does not match {self.model_file.label}'s model or optimizer "
                               f"({_one_line(e)[:200]})", BAD_INPUT) from None
        self._account(t.optimizer)  # the loaded state was made outside measure()
        restore_rng(st["rng"], self.cuda)
        if st["data"].get("hook") not in (None, self.data_hook):
            self.notes.append(Note(f"the checkpoint was trained on {st['data']['hook']}() data, this run uses "
                                   f"{self.data_hook}()", warning=True))
        if self.plan != self.file_config.plan:
            self.notes.append(Note(f"resuming with the checkpoint's plan: {self.plan.describe()} (the config "
                                   f"says {self.file_config.plan.describe()})"))

    def _nvml(self) -> int | None:
        now = time.monotonic()
        if now - getattr(self, "_nvml_at", -1e9) >= 2.0:  # NVML init + query costs milliseconds: not every step
            self._nvml_at = now
            try:
                self._nvml_last = _nvml_used_bytes(self.device)
            except Exception:
                self._nvml_last = None
        return getattr(self, "_nvml_last", None)

    def _write_metrics(self, metrics: dict) -> None:
        with open(self.run_dir / METRICS, "a") as f:
            f.write(json.dumps(metrics) + "\n")

    def _truncate_metrics(self) -> None:
        """On resume, drop lines past the checkpoint's step (written after it by the run that was killed), so
        metrics.jsonl reads as one run."""
        path = self.run_dir / METRICS
        if not path.exists():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= self.step:
                    kept.append(line)
            except (json.JSONDecodeError, AttributeError):
                continue  # a line cut short by a kill
        atomic_write(path, "".join(k + "\n" for k in kept))


def train(config_path: str | Path, *, overrides: dict[str, Any] | None = None, device: str | None = None,
          budget: str | None = None, resume: bool = False,
          on_event: Callable[[Event], None] | None = None) -> TrainResult:
    """Train with the config's plan. Bad input raises OomtuneError before any file is written."""
    return Trainer(config_path, overrides=overrides, device=device, budget=budget, resume=resume,
                   on_event=on_event).run()

