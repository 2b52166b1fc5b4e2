"""The Python API: `oomtune.probe`, `oomtune.estimate` and `oomtune.check`, what the commands run, for a notebook or
a script. Each takes a model (a model file's path, or a module or object that has the hooks) or a config, returns
the result the command renders (`.plan`, `.config`, `.breakdown`), prints nothing of its own (the libraries a model
file imports may warn; the commands quiet them), and raises OomtuneError (with its one line) for bad input.

    import oomtune
    result = oomtune.estimate("examples/tiny_gpt.py", gpu="rtx3060", batch=256, context=512)
    result.plan, result.breakdown.peak_bytes

The commands are built on this module: each checks its input and loads the model here (`prepare_probe`,
`prepare_estimate`), prints its header, runs the job with its progress callbacks, and writes what the job found
(`Job.write`): the same steps as the functions, in the same order, with a printer around them. `before_writing`:
called after the last trial and before any file is written (the commands stop there on a Ctrl-C Python dropped).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .config.schema import HEADROOM, TRIAL_STEPS, Config, ModelSection, TrialRecord
from .errors import ConfigError, OomtuneError
from .model_file import ModelFile
from .model_import import unguarded_api_call
from .models.source import changed, model_file_of, open_model


def keeps_callers_rng(fn: Callable) -> Callable:
    """`fn` leaves the caller's random number generators as they were: trials build models and draw batches, and a
    notebook that seeded torch should not see its stream move. The CPU generator, and CUDA's where CUDA was already
    in use (forking it would start CUDA, and take a context's memory, in a process that may not use the GPU)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        import torch

        cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=cuda):
            return fn(*args, **kwargs)

    return wrapped


OnStart = Callable | None
OnTrial = Callable[[TrialRecord], None] | None
Hook = Callable[[], None] | None


@dataclass
class Job:
    """A probe or an estimate, checked and loaded, not yet run: `run` searches (on `device`, made by `connect`),
    `write` writes the config to `out` (and the memory snapshot) and says whether the train: section already
    there was kept."""

    kind: str  # "probe" | "estimate"
    model_file: ModelFile
    targets: object
    options: dict
    out: Path | None
    header: str
    snapshot: Path | None = None
    device: object = None
    dist: object = None
    notes: list[str] = field(default_factory=list)
    where: tuple = ("auto", None, None, None)  # probe: the device kind, budget, card and margin of its device

    def connect(self, dist_timeout: float = 0.0, launched: bool = False) -> Job:
        """The probe's device (auto: cuda where PyTorch sees a GPU, else cpu), and its ranks where torchrun
        `launched` this process."""
        from .search.probe import probe_on_ranks

        kind, budget, gpu, margin = self.where
        self.device, self.dist = probe_on_ranks(kind, budget, dist_timeout, launched, gpu, margin)
        return self

    @keeps_callers_rng
    def run(self, on_start: OnStart = None, on_trial: OnTrial = None, on_begin: Callable | None = None):
        """The search; `on_begin(estimating)` (probe) once its input is checked, before the first trial (True:
        the estimate on fake tensors runs first)."""
        from .memory.threads import simulated_threads, with_threads

        if self.kind == "estimate":
            from .search.estimate import estimate as run_estimate

            with simulated_threads(self.device.kind):  # (nothing computes: no speed to tell)
                return run_estimate(self.model_file, self.device, self.targets, on_start=on_start,
                                    on_trial=on_trial, **self.options)
        from .search.probe import probe as run_probe

        if self.device is None:
            self.connect()
        with simulated_threads(self.device.kind) as threads:  # (cpu: the count its tokens/s are measured with)
            result = run_probe(self.model_file, self.device, self.targets, on_start=on_start, on_trial=on_trial,
                               dist=self.dist, on_begin=on_begin, **self.options)
        return with_threads(result, threads, self.device.kind)

    @keeps_callers_rng
    def savings(self, result, on_lever: Callable[[str], None] | None = None) -> tuple:
        """estimate --breakdown: what each lever of the plan it broke down takes off its peak (search/savings.py)."""
        from .search.savings import lever_savings

        return lever_savings(self.model_file, result.breakdown_plan, self.device, result.breakdown.peak_bytes,
                             self.options["steps"], on_lever)

    @keeps_callers_rng
    def write(self, result, before_writing: Hook = None) -> bool:
        """The snapshot's trial of the plan found (estimate: of the plan it broke down, the smallest where nothing
        fits), then `before_writing`, then the config to `out` (where given and something fits) and the snapshot.
        True when the train: section of the config already at `out` was kept."""
        from .config.output import write_config

        plan = result.breakdown_plan if self.kind == "estimate" else result.plan
        taken = take_snapshot(self.snapshot, self.model_file, plan, self.device, self.options["steps"])
        if before_writing is not None:
            before_writing()
        kept = False
        if self.out is not None and result.config is not None:
            kept, note = write_config(result.config, self.out, _named(self.model_file), self.header)
            search = result.search if self.kind == "estimate" else result
            search.notes += (note,) if note else ()
        write_snapshot(self.snapshot, taken)
        return kept


def prepare_probe(model, *, batch: int | None = None, context: int | None = None, min_context: int | None = None,
                  device: str = "auto", budget: str | None = None, gpu: str | None = None,
                  headroom: float = HEADROOM, steps: int = TRIAL_STEPS, objective: str = "fit", amp: str = "auto",
                  levers: str | None = None, prior: bool | str | None = None, out: str | Path | None = None,
                  memory_snapshot: str | Path | None = None, on_ranks: bool = False,
                  header: str | None = None, margin: str | None = None) -> Job:
    """Everything `probe` checks before its first trial (the options, `out`, the snapshot's path, the model, the
    targets); `on_ranks`: the job runs on several ranks (no snapshot there, no prior)."""
    from .memory import snapshot
    from .memory.devices import resolve_kind
    from .search.options import check_prior, check_search_options, parse_levers, resolve_targets

    check_search_options(headroom, steps, objective, amp)
    check_prior(prior, resolve_kind(device) if prior else device, on_ranks)
    allowed = parse_levers(levers)
    out = _check_out(out, model)
    snapshot.check_path(_path(memory_snapshot), on_ranks=on_ranks, others=(out, _model_path(model)))
    model_file = model_file_of(model)
    _check_named(out, model, model_file)
    targets = resolve_targets(model_file, batch, context, min_context)
    options = {"headroom": headroom, "steps": steps, "objective": objective, "amp": amp, "levers": allowed,
               "prior": prior}
    return Job("probe", model_file, targets, options, out, header or f"written by oomtune.probe({model_file.label})",
               _path(memory_snapshot), where=(device, budget, gpu, margin))


def probe(model, *, batch: int | None = None, context: int | None = None, min_context: int | None = None,
          device: str = "auto", budget: str | None = None, gpu: str | None = None, headroom: float = HEADROOM,
          steps: int = TRIAL_STEPS, objective: str = "fit", amp: str = "auto", levers: str | None = None,
          prior: bool | str | None = None, out: str | Path | None = None, memory_snapshot: str | Path | None = None,
          on_start: OnStart = None, on_trial: OnTrial = None, margin: str | None = None):
    """`oomtune probe` on one process: the ladder on `device` (auto: cuda where PyTorch sees a GPU, else cpu),
    starting from the estimate where `prior` ("auto": where one trial timed on the device and one on fake tensors
    say it pays; None: "auto" on cuda, none on cpu). Returns the ProbeResult (`.plan` and `.config`
    None when nothing fits); `out`: also write the config there; `memory_snapshot`: the plan's trial, for
    PyTorch's memory viewer."""
    job = prepare_probe(model, batch=batch, context=context, min_context=min_context, device=device, budget=budget,
                        gpu=gpu, headroom=headroom, steps=steps, objective=objective, amp=amp, levers=levers,
                        prior=prior, out=out, memory_snapshot=memory_snapshot, margin=margin)
    result = job.connect().run(on_start, on_trial)
    job.write(result)
    return result


def prepare_estimate(model, *, budget: str | None = None, gpu: str | None = None, margin: str | None = None,
                     batch: int | None = None, context: int | None = None, min_context: int | None = None,
                     headroom: float = HEADROOM, steps: int = TRIAL_STEPS, objective: str = "fit",
                     amp: str = "auto", levers: str | None = None, world_size: int = 1,
                     sharding: str | None = None, out: str | Path | None = None,
                     memory_snapshot: str | Path | None = None, header: str | None = None) -> Job:
    """Everything `estimate` checks before its first trial, and its fake device (`notes`: what the user should
    know about the card before it runs)."""
    from .memory import snapshot
    from .search.estimate import make_fake_device, no_bf16_note
    from .search.options import check_estimate_options, check_world, parse_levers, resolve_targets

    check_estimate_options(objective, headroom, steps, amp)
    check_world(world_size, sharding)
    allowed = parse_levers(levers)
    out = _check_out(out, model, "estimate")
    snapshot.check_path(_path(memory_snapshot), others=(out, _model_path(model)))
    model_file = model_file_of(model)
    _check_named(out, model, model_file, "estimate")
    targets = resolve_targets(model_file, batch, context, min_context)
    device = make_fake_device(budget, gpu, margin)
    options = {"headroom": headroom, "steps": steps, "objective": objective, "amp": amp, "levers": allowed,
               "world_size": world_size, "sharding": sharding}
    header = header or (f"written by oomtune.estimate({model_file.label}): predicted on fake tensors, never measured "
                        "on a GPU")
    note = no_bf16_note(device, amp)
    return Job("estimate", model_file, targets, options, out, header, _path(memory_snapshot), device,
               notes=[note] if note else [])


def estimate(model, *, budget: str | None = None, gpu: str | None = None, margin: str | None = None,
             batch: int | None = None, context: int | None = None, min_context: int | None = None,
             headroom: float = HEADROOM, steps: int = TRIAL_STEPS, amp: str = "auto", levers: str | None = None,
             world_size: int = 1, sharding: str | None = None, out: str | Path | None = None,
             memory_snapshot: str | Path | None = None, on_start: OnStart = None, on_trial: OnTrial = None):
    """`oomtune estimate`: the ladder on the fake device for a card (`gpu`) or a budget, no GPU needed. Returns the
    EstimateResult (`.plan`, `.config`, `.breakdown`: of the chosen plan, or of the smallest when nothing fits)."""
    job = prepare_estimate(model, budget=budget, gpu=gpu, margin=margin, batch=batch, context=context,
                           min_context=min_context, headroom=headroom, steps=steps, amp=amp, levers=levers,
                           world_size=world_size, sharding=sharding, out=out, memory_snapshot=memory_snapshot)
    result = job.run(on_start, on_trial)
    job.write(result)
    return result


@keeps_callers_rng
def what_if(model, micro_batch: int, *, context: int | None = None, precision: str | None = None,
            checkpointing: bool | None = None, grad_accum: int | None = None, budget: str | None = None,
            gpu: str | None = None, margin: str | None = None, headroom: float = HEADROOM,
            steps: int = TRIAL_STEPS, world_size: int = 1, sharding: str | None = None,
            memory_snapshot: str | Path | None = None, before_writing: Hook = None, levers: str | None = None,
            savings: bool = False, on_lever: Callable[[str], None] | None = None):
    """`oomtune estimate --micro-batch`: one plan's breakdown on fake tensors and, given a budget or a card,
    whether it fits; `levers`: the levers past accumulation the plan uses (8bit, nf4, offload, ...); `savings`:
    what each of them takes off the peak too (one more estimate each, `on_lever(label)` told before it). Returns
    the WhatIf (`.plan`, `.breakdown`, `.fits`, `.levers`, `.note`, `.savings`)."""
    from .memory import snapshot
    from .search.estimate import make_fake_device, no_bf16_note, what_if_plan
    from .search.estimate import what_if as run_what_if
    from .search.options import check_estimate_options, check_what_if_options, check_world

    check_what_if_options(micro_batch, precision, checkpointing, grad_accum, None, None)
    check_estimate_options("fit", headroom, steps, "auto")
    check_world(world_size, sharding)
    snapshot.check_path(_path(memory_snapshot), others=(_model_path(model),))
    model_file = model_file_of(model)
    plan = what_if_plan(model_file, micro_batch, context, precision, checkpointing, grad_accum, world_size, sharding,
                        levers)
    bounded = budget is not None or gpu is not None
    device = make_fake_device(budget if bounded else str(1 << 50), gpu, margin)
    result = run_what_if(model_file, plan, device, bounded=bounded, headroom=headroom, steps=steps)
    if savings:
        from .search.savings import lever_savings

        result = dataclasses.replace(result, savings=lever_savings(model_file, plan, device,
                                                                   result.breakdown.peak_bytes, steps, on_lever))
    _snapshot_of(memory_snapshot, model_file, plan, device, steps, before_writing)
    return result.with_note(no_bf16_note(device, plan.precision))


@keeps_callers_rng
def check(config: str | Path | Config, *, model=None, device: str = "fake", budget: str | None = None,
          headroom: float | None = None, margin: str | None = None, gpu: str | None = None,
          steps: int = TRIAL_STEPS, memory_snapshot: str | Path | None = None, before_writing: Hook = None):
    """`oomtune check`: does the config's plan (a config file's path, or a Config) still fit? Returns the
    CheckResult (`.fits`, `.plan`, `.breakdown`: the new one, on fake and cpu). `model`: the model (default: the
    config's model file)."""
    from .config.loading import load_config
    from .memory import snapshot
    from .search.check import check as run_check

    path = None
    if not isinstance(config, Config):
        if not isinstance(config, (str, Path)):
            raise ConfigError(f"check's config must be a config file's path or a Config, got {config!r}")
        path = Path(config)
        config = load_config(path)
    named = config.model_path(path)
    snapshot.check_path(_path(memory_snapshot), others=(path, named if model is None else _model_path(model)))
    if model is None:  # the config's model, with the arguments it was found with: as it is now (the gate's point)
        model_file = open_model(config.model, config_path=path)
        grown = changed(config.model, path)
    else:
        grown = None
        model_file = model_file_of(model)
    from .memory.threads import simulated_threads

    with simulated_threads(device):
        result = run_check(config, model_file, device_kind=device, budget=budget, headroom=headroom, margin=margin,
                           steps=steps, gpu=gpu)
    if grown is not None:
        result = dataclasses.replace(result, notes=(*result.notes, f"{grown}: checked as it is now"))
    if model is not None and (_model_path(model) is None or config.model.on_hub or
                              _model_path(model).resolve() != named.resolve()):
        result = dataclasses.replace(result, notes=(*result.notes, f"checked {model_file.label} with the plan of "
                                                    f"{path or 'the config'}, which names {config.model.source}"))
    _snapshot_of(memory_snapshot, model_file, result.plan, result.measured_on, steps, before_writing)
    return result


def take_snapshot(path: Path | None, model_file: ModelFile, plan, device, steps: int) -> dict | None:
    """The memory viewer's snapshot of one trial of `plan` on `device` (None where no path or no plan)."""
    from .memory import snapshot

    return snapshot.take(model_file, plan, device, steps) if path is not None and plan is not None else None


def write_snapshot(path: Path | None, taken: dict | None) -> None:
    from .memory import snapshot

    if path is not None and taken is not None:
        snapshot.write(taken, path)


def _snapshot_of(path, model_file: ModelFile, plan, device, steps: int, before_writing: Hook) -> None:
    taken = take_snapshot(_path(path), model_file, plan, device, steps)
    if taken is not None and before_writing is not None:
        before_writing()
    write_snapshot(_path(path), taken)


def _model_path(model) -> Path | None:
    """The model's file where the caller named one (a path, or a module imported from a file)."""
    if isinstance(model, (str, Path)):
        return Path(model)
    if isinstance(model, ModelSection):
        return None if model.on_hub else Path(model.source)
    if isinstance(model, ModelFile):
        return model.path
    file = getattr(model, "__file__", None)
    return Path(file) if isinstance(file, str) else None


def _named(model_file: ModelFile) -> Path:
    """What a config names the model by (a Hugging Face config.json, not its folder; a Hub id, not the cache's)."""
    return Path(model_file.section.source) if model_file.section is not None else model_file.path


def _path(p: str | Path | None) -> Path | None:
    return None if p is None else Path(p)


def _check_out(out: str | Path | None, model, command: str = "probe") -> Path | None:
    """Before the model is loaded: `out` can be written (and is not the model file itself)."""
    from .config.output import check_out

    if out is None:
        return None
    out = Path(out)
    named = _model_path(model) if isinstance(model, (str, Path, ModelSection)) else None
    if named is not None and named.exists():  # (a missing one: loading it says so)
        check_out(out, named, command)
    return out


def _check_named(out: Path | None, model, model_file: ModelFile, command: str = "probe") -> None:
    """`out` names a model file `oomtune train` can load, not a notebook's object (a path was checked already)."""
    from .config.output import check_out

    if out is None or isinstance(model, (str, Path, ModelSection)):
        return
    if not model_file.path.is_file():
        raise OomtuneError(f"out={out}: the model {model_file.label} is not a file a config can name (give the "
                           "model file's path, or a module imported from one)")
    check_out(out, model_file.path, command)
    called = unguarded_api_call(model_file.path) if getattr(model, "__name__", None) == "__main__" else None
    if called is not None:
        raise OomtuneError(f"out={out}: {model_file.label} is the script running now, and its top level calls "
                           f"{called[0]}() (line {called[1]}): `oomtune train --config {out}` imports it and would "
                           "run that again; put the call under `if __name__ == \"__main__\":`")
