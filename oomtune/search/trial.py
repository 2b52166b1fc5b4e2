"""A trial: run one plan for a few optimizer steps on a device and report fits/OOM, peak and speed."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

from .. import rank_allocation
from ..config.schema import TRIAL_STEPS, Plan, TrainConfig
from ..dist.group import LOCAL, Dist, RanksOutOfMemory
from ..errors import ModelFileError, first_line
from ..memory.allocator import rounded
from ..memory.devices import Device, FakeDevice, is_oom
from ..memory.fakes import NeedsValues
from ..memory.layer_drop import every_layer
from ..memory.replay import Trace
from ..memory.tracker import storage_key, untracked
from ..model_file import ModelFile, is_compiled
from ..step import Training, build_training, every_gradient_made, make_optimizer_state, release_tensor_hooks, train_step
from .fewer_blocks import FewerBlocks
from .second_steps import SecondSteps

T = TypeVar("T")

# k >= 2 accumulated micro-steps need the memory of 2 (the gradients accumulate in place): a trial computes at
# most 2 per step. It holds all k micro-batches, as the trainer does (it draws a whole step's, to retry them).
ACCUM_IN_TRIAL = 2
# fp16: the GradScaler skips the optimizer step while the gradients overflow at its scale (65536 at first,
# halved at each skip); a trial whose steps were all skipped never made the optimizer state. Run up to this
# many more steps until one is taken.
MAX_SKIPPED_STEPS = 24


class ModelCache:
    """The model a probe's trials reuse while only the micro-batch, context or accumulation changes: it is built
    (and checkpoint-wrapped) once per rung, and before each later trial its trained weights and its buffers are put
    back as they were built and its gradients dropped (each trial's optimizer, and so its state, is new). Only on
    a device that computes (a fake tensor belongs to the fake mode of the trial that made it), on one process, and
    not with NF4 weights (building them is the host memory the plan needs, reported by the trial that builds)."""

    def __init__(self):
        self.key: Plan | None = None  # key_of the plan the model was built for
        self.model = None
        self.saved: list = []  # (tensor, its values as built, on the host) for the trained weights and buffers

    @staticmethod
    def reusable(plan: Plan, device: Device) -> bool:
        return device.computes and plan.sharding == "none" and not plan.nf4_frozen_weights

    @staticmethod
    def key_of(plan: Plan) -> Plan:
        """The plan without what a built model does not depend on (the rung)."""
        return dataclasses.replace(plan, micro_batch_size=1, context_length=1, grad_accum_steps=1,
                                   global_batch_size=0, chunked_loss=False, optimizer_in_backward=False)

    def take(self, plan: Plan, device: Device, reusable: bool = True):
        """The model for `plan`, as it was built, or None: build one. A model kept for another rung, or for a plan
        that cannot reuse it, is dropped first and its memory given back (device.release), so that no trial runs
        beside another's model."""
        if not reusable or self.key != self.key_of(plan):
            self.close(device)
            return None
        with torch.no_grad():
            for t, values in self.saved:
                t.copy_(values)
        for p in self.model.parameters():
            p.grad = None
        rank_allocation.reset(self.model)  # AdaLoRA's scores of the last trial's steps
        return self.model

    def close(self, device: Device) -> None:
        """Let go of the kept model, its parameters' hooks emptied (release_tensor_hooks), and give its memory back."""
        if self.model is not None:
            release_tensor_hooks(self.model)
            self.key, self.model, self.saved = None, None, []
            device.release()

    def keep(self, plan: Plan, model) -> None:
        """Remember a model just built for `plan`, with its trained weights' and buffers' values (not counted). Not
        a compiled one: reused at another batch size, it would recompile with dynamic shapes, which the trainer's
        fresh compile does not."""
        if is_compiled(model):
            return
        with untracked(), torch.no_grad():
            tensors = [p for p in model.parameters() if p.requires_grad] + list(model.buffers())
            self.saved = [(t, t.detach().to("cpu", copy=True)) for t in tensors]
        self.key, self.model = self.key_of(plan), model

    def held_bytes(self) -> int:
        """The bytes the kept model's tensors hold (512-byte blocks, each storage once): alive between trials by
        design, not left behind by the model file."""
        if self.model is None:
            return 0
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]  # (an OOM trial's, dropped by take)
        storages = {id(s): s for t in (*self.model.parameters(), *self.model.buffers(), *grads)
                    if t.layout == torch.strided and (s := t.untyped_storage()) is not None}
        return sum(rounded(s.nbytes()) for s in storages.values())


@contextlib.contextmanager
def kept_models(device: Device, wanted: bool = True) -> Iterator[dict]:
    """run_trial's keyword arguments for a search's trials: {"models": a ModelCache} where `wanted`, let go of (its
    last model's hooks emptied) when the search ends, however it ends; else {}."""
    cache = ModelCache() if wanted else None
    try:
        yield {"models": cache} if cache is not None else {}
    finally:
        if cache is not None:
            cache.close(device)


def held(models: ModelCache | None) -> int:
    return models.held_bytes() if models is not None else 0


@dataclass(frozen=True)
class TrialResult:
    plan: Plan
    oom: bool
    oom_message: str | None = None
    peak_bytes: int | None = None  # what must fit (reserved on cuda)
    peak_allocated_bytes: int | None = None
    batch_peak_bytes: int | None = None  # peak of forward/backward, the part that grows with the batch
    phase_peaks: dict | None = None
    step_seconds: float | None = None  # one optimizer step, after the first (warm-up) step
    tokens_per_s: float | None = None
    loss: float | None = None
    seconds: float = 0.0  # the whole trial, model build included
    host_peak_bytes: int = 0  # host memory the offloaded parts held at most (0 without the offload levers)
    build_seconds: float = 0.0  # of `seconds`: build_training (the model, its wrappers, its optimizer)
    modelled_reserved_bytes: int | None = None  # simulated devices: what the CUDA caching allocator would reserve
    trace: Trace | None = dataclasses.field(default=None, repr=False, compare=False)  # where the device traces
    replayed: bool = False  # from two traced trials (memory/replay.py), not run
    extrapolated: bool = False  # from trials of fewer of its repeated blocks (search/extrapolate.py)
    left_bytes: int = 0  # still alive once the trial let go of its memory, beyond what was before (leaks.py)
    second_step_made: bool = False  # its second step made from its first (second_steps.py)
    bounded: bool = False  # not run: out of memory since micro-batch 1 of it is (estimate.ReplayedTrials._bounded)
    kinds: tuple | None = dataclasses.field(default=None, repr=False, compare=False)  # its lives' parts, where
    # a breakdown recorded it (memory/life_kinds.py: a trace made from fewer blocks then has its own peak's parts)

    @staticmethod
    def from_reading(plan: Plan, reading, **kw) -> TrialResult:
        """A trial not run but read off a replayed trace (memory/replay.py): its peaks the `reading`'s; `kw`: how it
        was made (replayed, extrapolated, its trace, its seconds)."""
        return TrialResult(plan, oom=False, peak_bytes=reading.peak_bytes,
                           peak_allocated_bytes=reading.peak_allocated_bytes, batch_peak_bytes=reading.batch_peak_bytes,
                           phase_peaks=dict(reading.phase_peaks), host_peak_bytes=reading.host_peak_bytes,
                           modelled_reserved_bytes=reading.modelled_reserved_bytes, **kw)

    @property
    def step_peak_bytes(self) -> int | None:
        """The peak of the step's phases alone (forward, backward, optimizer): the build ("setup") left out."""
        return max((n for phase, n in (self.phase_peaks or {}).items() if phase != "setup"), default=None)


def _done_with(module, models: ModelCache | None) -> None:
    """A trial's model is let go of (unless the cache keeps it): its parameters' hooks too (release_tensor_hooks)."""
    if models is None or models.model is not module:
        release_tensor_hooks(module)


def _steps(model_file: ModelFile, plan: Plan, device: Device, steps: int, reading_box: list, built: list,
           observe: Callable[[Training, str], None] | None = None, dist: Dist = LOCAL, prime: bool = False,
           models: ModelCache | None = None) -> tuple:
    """(step seconds, tokens/s, the first loss, whether a primed trial saw every gradient); the build's seconds
    go into `built` as soon as it is done (a step that runs out of memory still has them). `prime`: make the
    optimizer state without a first step (make_optimizer_state), where the device computes no values. `models`:
    the model to reuse where the plan allows it (ModelCache)."""
    train_defaults = TrainConfig()  # the trial runs the step the trainer will run, clipping included
    missed: list[bool] = []  # primed: a step in which backward gave some trained parameter no gradient
    reuse = models is not None and dist.world_size == 1 and ModelCache.reusable(plan, device)
    model = models.take(plan, device, reuse) if models is not None else None
    with device.measure() as reading, contextlib.ExitStack() as held:
        reading_box.append(reading)
        start = time.perf_counter()
        t = build_training(model_file, plan, device, lr=train_defaults.lr,
                           clip_grad_norm=None if plan.optimizer_in_backward else train_defaults.clip_grad_norm,
                           dist=dist, model=model)
        held.enter_context(every_layer(t.module))  # a LayerDrop model runs every layer: the worst case
        held.callback(_done_with, t.module, models)
        if reuse and model is None:
            models.keep(plan, t.module)
        del model
        built.append(time.perf_counter() - start)
        loss, primed = None, False

        def on_phase(phase: str) -> None:
            device.mark(reading, phase)
            if observe is not None:
                observe(t, phase)  # noqa: F821  (a closure cell: `del t` below empties it, breaking the cycle)
            if primed and phase == "optimizer" and not every_gradient_made(t):  # noqa: F821
                missed.append(True)  # the primed state holds some a real first step would not have made

        t.on_phase = on_phase
        micro = min(plan.grad_accum_steps, ACCUM_IN_TRIAL)
        if prime and steps > 1:
            loss = make_optimizer_state(t)  # the fake device: the first step's state, without the step
            primed = loss is not None
            steps -= primed
        timings: list[float] = []
        first_loss = None
        scaled = device.computes and t.scaler.is_enabled()  # (the fake device takes every step: see fakes.Values)
        taken = i = 0
        events = reading.events = getattr(getattr(device, "tracker", None), "events", None)  # (a traced one's)
        points: list[int] = []  # where each step began and returned in them (second_steps.py)
        while i < steps or (scaled and not taken and i < steps + MAX_SKIPPED_STEPS):
            if events is not None:
                points.append(len(events))
            batches = [model_file.batch(plan.micro_batch_size, plan.context_length, device.torch_device)
                       for _ in range(plan.grad_accum_steps)]
            scale = t.scaler.get_scale() if scaled else None
            start = time.perf_counter()
            t.last_of_trial = i == steps - 1 and not scaled  # (a skipped step is taken again)
            loss = train_step(t, batches[:micro])
            if events is not None:
                points.append(len(events))
                reading.loss_key = reading.loss_key or storage_key(loss)
            device.synchronize()
            timings.append(time.perf_counter() - start)
            del batches
            taken += scale is None or t.scaler.get_scale() >= scale  # the scale drops exactly when it skipped
            if i == 0 and device.computes:
                first_loss = float(loss)  # a sync point, once per trial
                if not math.isfinite(first_loss):
                    raise ModelFileError(
                        f"{model_file.label}: the loss is {first_loss} at micro-batch {plan.micro_batch_size}, "
                        f"context {plan.context_length}, {plan.precision} (check the model's init and inputs)"
                    )
            i += 1
        reading.points = (*points, len(events)) if events is not None else ()
        if observe is not None:
            observe(t, "end")
        del t, loss
    timed = timings[1:] or timings
    step_s = sum(timed) / len(timed)
    tokens = plan.micro_batch_size * plan.context_length * micro
    # no speed where nothing was computed (the fake device times only Python) or where it is not the GPU's
    return step_s, tokens / step_s if step_s > 0 and device.measures_speed else None, first_loss, not missed


@contextlib.contextmanager
def settled_objects() -> Iterator[None]:
    """Inside, the objects alive on entry are left out of garbage collections (gc.freeze after one collection),
    and on exit they are collected as before (gc.unfreeze). A search runs inside it: what lives when it starts (the
    imported libraries - torch alone is ~170k objects, transformers doubles it - the model file's module, the
    caller's state) lives to its end, and the full collection after each trial (Device.release) then walks only
    what was made since (0.1-0.3 s a trial less). A garbage cycle through an object frozen here waits for the
    exit. The trainer, which must free a failed plan's model at once, does not use it. Nested, only the outermost
    freezes and unfreezes.

    The first optimizer step imports torch._dynamo (torch.optim's steps are wrapped to keep dynamo out), and with
    it sympy, mpmath and numpy.random: ~120k objects that live as long as the libraries. Imported here, before the
    freeze, they are left out too; imported by the first trial, every later trial's collection walked them (a cpu
    trial of examples/tiny_gpt.py at micro-batch 1-8: 0.13-0.14 s -> 0.04-0.07 s, of which the collection was
    60-75 ms).

    A library the first trial would import is imported here too, where that is known (_libraries_first)."""
    if _SETTLED:
        yield
        return
    import torch._dynamo  # noqa: F401 - see above

    _libraries_first()

    gc.collect()
    gc.freeze()
    _SETTLED.append(True)
    try:
        yield
    finally:
        _SETTLED.clear()
        gc.unfreeze()


_SETTLED: list[bool] = []  # inside settled_objects


def imports_settled() -> None:
    """At a command's start, once its imports and the model file are loaded: what the process holds then (torch,
    transformers, the model file's module: ~300k objects) is left out of garbage collections (gc.freeze), with no
    collection first, there being next to no garbage yet. The search's own collection before its freeze
    (settled_objects) then walks only what was made since: 0.1 s less on GPT-2 small's 2 s estimate here. Its end
    unfreezes both. The CLI's estimate only (fake tensors: frozen garbage would hold host memory, never a device's),
    not the library's functions, whose caller's garbage is its own."""
    gc.freeze()


_IMPORTED: list[bool] = []  # _libraries_first's imports tried


def _libraries_first() -> None:
    """PEFT imports bitsandbytes (where installed) as it wraps a model's layers, so a LoRA model's first build did,
    inside the first trial: its objects (70,600 with what it imports, `kernels` among them) were then made after the
    freeze, and every later trial's collection walked them. Where the model file has imported PEFT, bitsandbytes is
    imported before the freeze, outside every mode (levers.nf4_bnb.library); one that fails to import is left for
    PEFT to meet as it did. What an import inside a trial makes is not the trial's either way (memory/imports.py)."""
    if _IMPORTED or "peft" not in sys.modules:
        return
    _IMPORTED.append(True)  # (tried once: an import that fails is not tried at every trial)
    if "bitsandbytes" in sys.modules or importlib.util.find_spec("bitsandbytes") is None:
        return
    from ..levers.nf4_bnb import library

    with contextlib.suppress(Exception):
        library()


def computing_where_needed(device: Device, label: str, run: Callable[[], T]) -> tuple[T, tuple[str, ...]]:
    """`run()` and no notes; where the fake device met an op that needs tensor values (fakes.NeedsValues: nonzero
    routing tokens), `run()` once more on real tensors computed on the cpu, and the note that says so."""
    try:
        return run(), ()
    except NeedsValues as e:
        if not isinstance(device, FakeDevice) or device.computes or not device.may_compute:
            raise
        note = (f"{label}: {e.message}, so it was measured on real tensors computed on the cpu (the same tracker "
                "and margin; slower, and it needs the RAM)")
    device.release()  # outside the except block, whose traceback holds the failed trial's tensors
    device.compute_instead()
    return run(), (note,)


def run_trial(model_file: ModelFile, plan: Plan, device: Device, steps: int = TRIAL_STEPS,
              observe: Callable[[Training, str], None] | None = None, dist: Dist = LOCAL,
              models: ModelCache | None = None, second: SecondSteps | None = None) -> TrialResult:
    """Run `steps` optimizer steps of `plan`. An OOM is a result, not an error; any other error is the
    user's and propagates. Memory is given back outside the `except` block (its frames hold the
    failed step's tensors). `observe(training, phase)` is told each phase as it starts, after the
    device marked it, and "end" after the last step (the memory breakdown tags tensors there).

    On several ranks (`dist`) every rank runs the trial and all of them return the same result: an OOM on any
    rank is an OOM (the ranks agree, see oomtune.parallel), the peaks are the largest over the ranks and the
    speed is the sum of theirs. `models`: reuse the model built for an earlier trial where only the micro-batch,
    context or accumulation changed (ModelCache). `second`: the estimate's traced trials, whose second step is
    made from the first where that was checked (second_steps.py)."""
    start = time.perf_counter()
    fewer = isinstance(model_file, FewerBlocks)  # (its second steps are checked apart from the whole model's)
    mode = second.mode(plan, device, steps, dist.world_size, fewer) if second is not None else None
    box: list = []
    oom_message = None
    built: list[float] = []  # the build's seconds (none where the build itself ran out of memory)
    agreed = False
    alive = device.live_bytes() - held(models)  # what lives already (what a model file keeps from before)
    try:
        step_s, tps, loss, complete = _steps(model_file, plan, device, 1 if mode == "make" else steps, box, built,
                                             observe, dist, device.primes, models)
        if not complete:  # primed state a real first step would not have made: measure both steps instead
            box.clear()
            device.release()
            tracker = getattr(device, "tracker", None)
            if tracker is not None and tracker.recorder is not None:  # a breakdown's: the rerun's storages only
                tracker.recorder = tracker.recorder.restarted(tracker)
            step_s, tps, loss, _ = _steps(model_file, plan, device, steps, box, built, observe, dist)
    except ModelFileError as e:  # which sizes broke it (a context past the model's positions, say)
        if e.raised and " (in the trial of " not in e.message:
            e.message += f" (in the trial of {plan.describe(with_global=False)})"
        raise
    except Exception as e:
        if not is_oom(e):
            raise
        oom_message = first_line(e)
        agreed = isinstance(e, RanksOutOfMemory)  # every rank knows already: no other agreement for this trial
    device.release()
    left = device.live_bytes() - held(models) - alive
    if not agreed:
        try:
            dist.agree(oom_message)  # one process: nothing to agree on
        except RanksOutOfMemory as e:
            oom_message = oom_message or first_line(e)
    seconds = time.perf_counter() - start
    build_s = sum(built)  # (both builds where the trial ran twice)
    if oom_message is not None:
        return TrialResult(plan, oom=True, oom_message=oom_message, seconds=seconds, build_seconds=build_s,
                           left_bytes=left)
    reading = box[0] if mode is None else second.finish(plan, box[0], device, mode, fewer)
    peak, allocated, batch_peak = reading.peak_bytes, reading.peak_allocated_bytes, reading.batch_peak_bytes
    host = int(dist.max(reading.host_peak_bytes)[0])
    phases = dict(reading.phase_peaks)
    # what every rank must fit: the largest; the speed of the whole job: the sum (one process: its own)
    names = sorted(phases)
    peak, allocated, batch, step_s, *per_phase = dist.max(peak, allocated, batch_peak or -1, step_s,
                                                         *(phases[n] for n in names))
    peak, allocated, batch_peak = int(peak), int(allocated), (int(batch) if batch >= 0 else None)
    phases = {n: int(v) for n, v in zip(names, per_phase, strict=True)}
    tps = dist.sum(tps)[0] if tps is not None else None
    return TrialResult(plan, oom=False, peak_bytes=peak, peak_allocated_bytes=allocated,
                       batch_peak_bytes=batch_peak, phase_peaks=phases, step_seconds=step_s,
                       tokens_per_s=tps, loss=loss, seconds=seconds, host_peak_bytes=host,
                       build_seconds=build_s, modelled_reserved_bytes=reading.modelled_reserved_bytes,
                       trace=reading.trace, left_bytes=left, second_step_made=mode == "make")
