"""What `oomtune train` reports: the events the CLI renders (library code never prints) and the run's result."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config.schema import Plan, TrainConfig


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
    reason: str  # interval | final | interrupted | oom | diverged | error
    pretrained: Path | None = None  # the adapter / model folder written beside it (train/pretrained.py)


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
    config_updated: bool = False  # the config file now holds `plan` (a fallback's plan was written back)
    start_step: int = 0  # the step this invocation started from (a resume's checkpoint step)

    @property
    def nothing_to_do(self) -> bool:
        """A resume of a run already at (or past) train.steps: no step was run."""
        return self.start_step >= self.steps
