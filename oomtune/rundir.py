"""The run directory's log files: metrics.jsonl (one JSON object per logged step) and events.jsonl (start,
resume, checkpoints, OOM fallbacks, config updates, interruption, finish)."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from .files import atomic_write

METRICS = "metrics.jsonl"  # one JSON object per logged step: step, loss, lr, tokens_per_s, peak_bytes[, eval_loss]
EVENTS = "events.jsonl"  # start / resume / oom_fallback / config_updated / checkpoint / interrupted / finished


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat()


class RunLog:
    """Appends to the run dir's metrics.jsonl and events.jsonl (on several ranks, rank 0 alone: `enabled`)."""

    def __init__(self, run_dir: Path, enabled: bool = True):
        self.run_dir = Path(run_dir)
        self.enabled = enabled

    def event(self, kind: str, always: bool = False, **fields) -> None:
        """`always`: written by this rank even when it is not rank 0 (it alone knows, and the others are stopped)."""
        if not (self.enabled or always):
            return
        with open(self.run_dir / EVENTS, "a") as f:
            f.write(json.dumps({"time": now(), "event": kind, **fields}) + "\n")

    def metrics(self, metrics: dict) -> None:
        if not self.enabled:
            return
        with open(self.run_dir / METRICS, "a") as f:
            f.write(json.dumps(metrics) + "\n")

    def truncate_metrics(self, step: int) -> None:
        """On resume, drop lines past the checkpoint's `step` (written after it by the run that was killed), so
        metrics.jsonl reads as one run."""
        path = self.run_dir / METRICS
        if not self.enabled or not path.exists():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except (json.JSONDecodeError, AttributeError):
                continue  # a line cut short by a kill
        atomic_write(path, "".join(k + "\n" for k in kept))
