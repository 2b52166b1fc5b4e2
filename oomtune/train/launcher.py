"""`oomtune train --nproc-per-node N`: the trainer on every rank under torchrun, relaunched after an FSDP
out-of-memory stop. A rank that ran out of memory inside FSDP's collectives stops the run after writing the halved
plan to the config (exit OOM_RELAUNCH); the launcher then starts every rank again from the last checkpoint (or
from the start, when the run had none yet) with that plan, up to MAX_RELAUNCHES times (each halves the
micro-batch). On several nodes the relaunch is left to whoever started them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..dist.launch import Launch, run
from ..errors import BAD_INPUT, OOM_RELAUNCH, OomtuneError
from .checkpoint import latest_checkpoint, remove
from .inputs import check_inputs
from .rundir import METRICS, in_use_message, run_dir_user

MAX_RELAUNCHES = 4


def launch_training(launch: Launch, config: Path, overrides: dict[str, Any], resume: bool,
                    worker_args: Callable[[bool], list[str]],
                    on_relaunch: Callable[[Path | None], None] | None = None) -> None:
    """Check the inputs once here (bad input before any rank starts), then torchrun `oomtune <worker_args(resume)>`
    on every rank of this node; `on_relaunch(checkpoint or None)` is told before each relaunch."""
    launch.check()
    inputs = check_inputs(config, overrides, resume=resume, world_size=launch.world_size)
    for attempt in range(MAX_RELAUNCHES + 1):
        try:
            run(launch, worker_args(resume))
            return
        except OomtuneError as e:
            if e.exit_code != OOM_RELAUNCH or attempt == MAX_RELAUNCHES or launch.nnodes > 1:
                raise
            latest = latest_checkpoint(inputs.run_dir)
            if latest is None:
                if resume:
                    raise
                user = run_dir_user(inputs.run_dir)  # (another train took the run dir between the launches)
                if user is not None:
                    raise OomtuneError(in_use_message(inputs.run_dir, user), BAD_INPUT) from None
                remove(inputs.run_dir / METRICS)  # this launch's own: the run starts over (events.jsonl goes on)
            resume = latest is not None
            if on_relaunch is not None:
                on_relaunch(latest)
