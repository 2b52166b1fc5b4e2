"""The state of a training run, declared in one place: where the run stands (step, plan, phase, checkpoints,
fallbacks) as a dataclass the trainer updates and its collaborators read."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.schema import Config, Plan
from .events import OomFallback


class Phase(str, enum.Enum):
    """What the run is doing now: decides how an error is handled (retried, saved, or neither)."""

    DATA = "data"  # drawing a step's batches
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"  # the micro-batches are done, the update not yet (or partly) applied
    AFTER = "after"  # the step has finished: an error from here on leaves a whole state behind
    EVAL_DATA = "eval-data"  # drawing the eval batches, after the step they follow
    EVAL = "eval"
    CHECKPOINT = "checkpoint"  # writing one: an error here gets no second try

    @property
    def step_done(self) -> bool:
        """The optimizer step in flight has finished (evaluation and logging come after it)."""
        return self in (Phase.AFTER, Phase.EVAL_DATA, Phase.EVAL)


@dataclass
class RunState:
    """Where a run stands. `step` counts finished optimizer steps; the step in flight is `step + 1`."""

    plan: Plan  # the plan now: smaller than the config's after an out-of-memory fallback
    file_config: Config  # the config as on disk: what a fallback rewrites
    step: int = 0
    start_step: int = 0  # this invocation's first step (a resume's checkpoint step)
    good_plan: Plan | None = None  # the last plan a unit of work finished with (a resume starts there)
    phase: Phase = Phase.DATA
    last_checkpoint: Path | None = None
    checkpoint_step: int | None = None  # the step of last_checkpoint
    fallbacks: list[OomFallback] = field(default_factory=list)
    plan_dirty: bool = False  # a fallback's plan ran but is not yet written to the config
    step_rng: dict[str, Any] | None = None  # the RNG states at the start of the step in flight (a retry rewinds)

    def __post_init__(self):
        if self.good_plan is None:
            self.good_plan = self.plan

    @property
    def failing_step(self) -> int:
        """The step an error belongs to: the one in flight, or the one just finished (evaluation runs after it)."""
        return self.step if self.phase.step_done else self.step + 1

    @property
    def saved_now(self) -> bool:
        """The last checkpoint holds the state of the last finished step."""
        return self.checkpoint_step == self.step
