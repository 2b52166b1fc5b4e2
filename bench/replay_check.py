"""The prior's replays against the fake trials they stand for: each estimate the probe's prior runs in `make bench`
and `make bench-prior` is run again with every replayed size also run as a fake trial, and the two readings are
compared to the byte (peak, allocated peak, the forward and backward peak, every phase's peak, the caching allocator
model's reserved peak). bench_prior.py writes the count into its section of RESULTS.md."""

from __future__ import annotations

from oomtune.config.schema import TRIAL_STEPS, Plan
from oomtune.dist.group import LOCAL
from oomtune.memory.devices import CpuDevice
from oomtune.model_file import ModelFile, load_model_file
from oomtune.search.options import resolve_targets
from oomtune.search.prior import ReplayingTrials, prior_device
from oomtune.search.probe import probe
from oomtune.search.trial import TrialResult, run_trial

from .run import CASES, LARGE_CASES, ROOT


def reading(r: TrialResult) -> tuple:
    return r.peak_bytes, r.peak_allocated_bytes, r.batch_peak_bytes, r.phase_peaks, r.modelled_reserved_bytes


class CheckedReplays(ReplayingTrials):
    """ReplayingTrials that also runs each replayed size on the fake device and compares; the search goes on with
    the replay, as the prior's does."""

    def __init__(self):
        super().__init__()
        self.agreed = 0
        self.differed: list[str] = []

    def __call__(self, model_file: ModelFile, plan: Plan, device, steps: int = TRIAL_STEPS, dist=LOCAL):
        result = super().__call__(model_file, plan, device, steps, dist)
        if result.replayed:
            real = run_trial(model_file, plan, device, steps, dist=dist)
            if reading(real) == reading(result):
                self.agreed += 1
            else:
                self.differed.append(f"{model_file.label} {plan.describe()}")
        return result


def check(path: str, batch: int, context: int, budget: str, ladder: bool) -> CheckedReplays:
    """The prior's estimate for `oomtune probe --device cpu --budget BUDGET --headroom 0` (the whole ladder, or the
    fp32 rung alone), its replays checked (fresh trials, as each probe's prior has)."""
    mf = load_model_file(ROOT / path)
    levers = {} if ladder else {"levers": frozenset({"accumulation"})}
    checked = CheckedReplays()
    probe(mf, prior_device(CpuDevice(budget)), resolve_targets(mf, batch, context, None), headroom=0.0,
          command="estimate", trial=checked, prior=False, **levers)
    return checked


def cross_check(extra: list[tuple[str, int, int, str]]) -> dict:
    """Every estimate of make bench's cases (15), then `extra` (model, batch, context, budget: fp32 rung only):
    {"agreed": replays that read what the fake trial read, "differed": those that did not, "runs": estimates}."""
    runs = [(c.path, c.batch, c.context, budget, c.ladder) for c in (*CASES, *LARGE_CASES) for budget in c.budgets]
    runs += [(*e, False) for e in extra]
    agreed, differed = 0, []
    for run in runs:
        checked = check(*run)
        agreed += checked.agreed
        differed += checked.differed
    return {"agreed": agreed, "differed": differed, "runs": len(runs)}
