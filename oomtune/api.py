"""The Python API: `oomtune.probe`, `oomtune.estimate` and `oomtune.check`, what the commands run, for a notebook or
a script. Each takes a model (a model file's path, or a module or object that has the hooks) or a config, returns
the result the command renders (`.plan`, `.config`, `.breakdown`), prints nothing, and raises OomtuneError (with
its one line) for bad input.

    import oomtune
    result = oomtune.estimate("examples/tiny_gpt.py", gpu="rtx3060", batch=256, context=512)
    result.plan, result.breakdown.peak_bytes
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .config.schema import HEADROOM, TRIAL_STEPS, Config, TrialRecord
from .errors import OomtuneError
from .model_file import ModelFile, model_file_of


def probe(model, *, batch: int | None = None, context: int | None = None, min_context: int | None = None,
          device: str = "auto", budget: str | None = None, gpu: str | None = None, headroom: float = HEADROOM,
          steps: int = TRIAL_STEPS, objective: str = "fit", amp: str = "auto", levers: str | None = None,
          prior: bool | None = None, out: str | Path | None = None, on_start: Callable | None = None,
          on_trial: Callable[[TrialRecord], None] | None = None):
    """`oomtune probe` on one process: the ladder on `device` (auto: cuda where PyTorch sees a GPU, else cpu),
    starting from the estimate where `prior` (None: on cuda only). Returns the ProbeResult (`.plan` and `.config`
    None when nothing fits); `out`: also write the config there."""
    from .search.options import check_search_options, parse_levers, resolve_targets
    from .search.probe import probe as run_probe
    from .search.probe import probe_on_ranks

    check_search_options(headroom, steps, objective, amp)
    allowed = parse_levers(levers)
    model_file = model_file_of(model)
    _check_out(out, model_file)
    targets = resolve_targets(model_file, batch, context, min_context)
    dev, dist = probe_on_ranks(device, budget, 0.0, False, gpu)
    result = run_probe(model_file, dev, targets, headroom=headroom, steps=steps, objective=objective, amp=amp,
                       dist=dist, levers=allowed, prior=prior, on_start=on_start, on_trial=on_trial)
    _write(result.config, out, model_file, f"written by oomtune.probe({model_file.label})")
    return result


def estimate(model, *, budget: str | None = None, gpu: str | None = None, margin: str | None = None,
             batch: int | None = None, context: int | None = None, min_context: int | None = None,
             headroom: float = HEADROOM, steps: int = TRIAL_STEPS, amp: str = "auto", levers: str | None = None,
             world_size: int = 1, sharding: str | None = None, out: str | Path | None = None,
             on_start: Callable | None = None, on_trial: Callable[[TrialRecord], None] | None = None):
    """`oomtune estimate`: the ladder on the fake device for a card (`gpu`) or a budget, no GPU needed. Returns the
    EstimateResult (`.plan`, `.config`, `.breakdown`: of the chosen plan, or of the smallest when nothing fits)."""
    from .search.estimate import estimate as run_estimate
    from .search.estimate import make_fake_device
    from .search.options import check_estimate_options, check_world, parse_levers, resolve_targets

    check_estimate_options("fit", headroom, steps, amp)
    check_world(world_size, sharding)
    allowed = parse_levers(levers)
    model_file = model_file_of(model)
    _check_out(out, model_file)
    targets = resolve_targets(model_file, batch, context, min_context)
    device = make_fake_device(budget, gpu, margin)
    result = run_estimate(model_file, device, targets, headroom=headroom, steps=steps, amp=amp, levers=allowed,
                          world_size=world_size, sharding=sharding, on_start=on_start, on_trial=on_trial)
    _write(result.config, out, model_file, f"written by oomtune.estimate({model_file.label}): predicted on fake "
                                           "tensors, never measured on a GPU")
    return result


def check(config: str | Path | Config, *, model=None, device: str = "fake", budget: str | None = None,
          headroom: float | None = None, margin: str | None = None, gpu: str | None = None,
          steps: int = TRIAL_STEPS):
    """`oomtune check`: does the config's plan (a config file's path, or a Config) still fit? Returns the
    CheckResult (`.fits`, `.plan`, `.breakdown`: the new one, on fake and cpu). `model`: the model (default: the
    config's model file)."""
    from .config.loading import load_config
    from .search.check import check as run_check

    path = None
    if not isinstance(config, Config):
        path = Path(config)
        config = load_config(path)
    if model is None:
        model = config.model_path(path) if path is not None else Path(config.model)
    return run_check(config, model_file_of(model), device_kind=device, budget=budget, headroom=headroom,
                     margin=margin, steps=steps, gpu=gpu)


def _check_out(out: str | Path | None, model_file: ModelFile) -> None:
    """Before any trial: `out` can be written, and names a model file `oomtune train` can load."""
    from .config.output import check_out

    if out is None:
        return
    if not model_file.path.is_file():
        raise OomtuneError(f"out={out}: the model {model_file.label} is not a file a config can name (give the "
                           "model file's path, or a module imported from one)")
    check_out(Path(out), model_file.path)


def _write(config: Config | None, out: str | Path | None, model_file: ModelFile, header: str) -> None:
    from .config.output import write_config

    if out is not None and config is not None:
        write_config(config, Path(out), model_file.path, header)
