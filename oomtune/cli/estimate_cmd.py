"""`oomtune estimate`: the probe's ladder on the fake device, no GPU needed; or, with --micro-batch, one plan."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from ..config.schema import HEADROOM, TRIAL_STEPS
from . import app
from .console import err, fmt_bytes, out
from .guard import user_errors
from .options import (
    AmpOpt,
    BatchOpt,
    DebugOpt,
    GpuOpt,
    HeadroomOpt,
    JsonOpt,
    LeversOpt,
    MarginOpt,
    MinContextOpt,
    ModelArg,
    OutOpt,
    SnapshotOpt,
    StepsOpt,
    budget_option,
)
from .probe_cmd import write_found
from .render import breakdown_table, print_levers, render_search, render_what_if, trial_progress, write_snapshot

EstimateContextOpt = Annotated[int | None, typer.Option("--context", "-t", help="Target context length T (with "
                                                        "--micro-batch: the plan's context). Default: DEFAULTS, "
                                                        "else 512.")]
EstimateObjectiveOpt = Annotated[str, typer.Option(help="fit: the first rung that fits. (throughput needs measured "
                                                   "speed: use probe.)")]
MicroBatchOpt = Annotated[int | None, typer.Option("--micro-batch", help="Estimate this one plan instead of running "
                                                   "the ladder: its breakdown, and whether it fits.")]
PrecisionOpt = Annotated[str | None, typer.Option("--precision", help="With --micro-batch: fp32 | bf16 | fp16 "
                                                  "(default fp32).")]
CheckpointingOpt = Annotated[bool | None, typer.Option("--checkpointing/--no-checkpointing", help="With --micro-batch: "
                                                       "activation checkpointing.")]
GradAccumOpt = Annotated[int | None, typer.Option("--grad-accum", help="With --micro-batch: accumulation steps "
                                                  "(default 1).")]
WorldSizeOpt = Annotated[int, typer.Option("--world-size", help="Ranks (GPUs) to plan for: the per-rank peak is "
                                           "measured on rank 0 of a fake process group.")]
ShardingOpt = Annotated[str | None, typer.Option("--sharding", help="none | ddp | fsdp: every rung on this (default: "
                                                 "ddp rungs, then an fsdp rung, on several ranks).")]


def card_line(device, gpu: str | None) -> str:
    """Which card's rules the estimate follows, and the margin it adds: said even when nobody chose the card."""
    assumed = "" if gpu else ", assumed (no --gpu: give yours)"
    return f"card profile: {device.card_text()}{assumed}; margin: {device.margin.text()}"


def _ladder(model: Path, model_file, batch, context, min_context, budget, gpu, margin, options: dict,
            world_size: int, sharding: str | None, out_path: Path, as_json: bool, snapshot: Path | None) -> None:
    from ..config.writing import to_dict
    from ..search.estimate import estimate, make_fake_device, no_bf16_note
    from ..search.options import resolve_targets

    targets = resolve_targets(model_file, batch, context, min_context)
    device = make_fake_device(budget, gpu, margin)
    note = no_bf16_note(device, options["amp"])
    if not as_json:
        if note:
            err.print(f"[yellow]note:[/] {escape(note)}")
        ranks = f" x {world_size} ranks" if world_size > 1 else ""
        err.print(f"estimating [bold]{model_file.label}[/] for {device.name}{ranks}, budget "
                  f"{fmt_bytes(device.budget_bytes)} (fake tensors: nothing runs on a GPU): batch {targets.batch}, "
                  f"context {targets.context}"
                  + (f" (min {targets.min_context})" if targets.min_context < targets.context else ""))
        err.print(f"  {escape(card_line(device, gpu))}")
    with trial_progress(not as_json) as (on_start, on_trial):
        result = estimate(model_file, device, targets, on_start=on_start, on_trial=on_trial, world_size=world_size,
                          sharding=sharding, **options)
    kept = write_found(result.config, out_path, model,
                       header=f"written by `oomtune estimate {model}`: predicted on fake tensors, never measured on a "
                              "GPU (check it with `oomtune probe` there) - edit `train:` freely")
    write_snapshot(snapshot, model_file, result.breakdown_plan, device, options["steps"])
    extra = {"estimated": True, "margin": device.margin.describe(), "card": card_line(device, gpu),
             "breakdown": to_dict(result.breakdown),
             "breakdown_plan": to_dict(result.breakdown_plan), "levers": result.levers}

    def details():
        title = "breakdown" if result.config is not None else "breakdown of the smallest plan"
        out.print(breakdown_table(result.breakdown, result.breakdown_plan, result.search.limit_bytes, title))
        print_levers(result.levers, result.breakdown_plan)

    render_search(result.search, out_path if result.config else None, as_json, "estimate", extra, details,
                  kept_train=kept)


@app.command()
def estimate(
    model: ModelArg,
    budget: Annotated[str | None, budget_option("none: give --budget or --gpu", "The GPU memory to fit in: 24GiB, "
                                                "80GB; with --gpu also a percentage (80%)")] = None,
    gpu: GpuOpt = None,
    margin: MarginOpt = None,
    batch: BatchOpt = None,
    context: EstimateContextOpt = None,
    min_context: MinContextOpt = None,
    headroom: HeadroomOpt = HEADROOM,
    steps: StepsOpt = TRIAL_STEPS,
    objective: EstimateObjectiveOpt = "fit",
    amp: AmpOpt = "auto",
    levers: LeversOpt = None,
    micro_batch: MicroBatchOpt = None,
    precision: PrecisionOpt = None,
    checkpointing: CheckpointingOpt = None,
    grad_accum: GradAccumOpt = None,
    world_size: WorldSizeOpt = 1,
    sharding: ShardingOpt = None,
    out_path: OutOpt = Path("best.yaml"),
    memory_snapshot: SnapshotOpt = None,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
):
    """Predict the ladder without a GPU: run it on fake tensors (no compute, same memory accounting).

    Example: [cyan]oomtune estimate model.py --gpu a100-80 --batch 64 --context 2048[/]

    What-if: [cyan]oomtune estimate model.py --budget 24GiB --micro-batch 8 --context 1024 --precision bf16
    --checkpointing[/]
    """
    with user_errors(debug):
        from ..config.output import check_out
        from ..memory import snapshot
        from ..model_file import load_model_file
        from ..search.estimate import make_fake_device, no_bf16_note, what_if, what_if_plan
        from ..search.options import check_estimate_options, check_what_if_options, check_world, parse_levers

        one_plan = check_what_if_options(micro_batch, precision, checkpointing, grad_accum, batch, min_context)
        check_estimate_options(objective, headroom, steps, amp)  # both modes, before anything is loaded
        check_world(world_size, sharding)
        allowed = parse_levers(levers)
        if not one_plan:  # the ladder writes --out: check it before the search, not after
            check_out(out_path, model)
        snapshot.check_path(memory_snapshot)
        model_file = load_model_file(model)
        if not one_plan:
            _ladder(model, model_file, batch, context, min_context, budget, gpu, margin,
                    {"headroom": headroom, "steps": steps, "objective": objective, "amp": amp, "levers": allowed},
                    world_size, sharding, out_path, as_json, memory_snapshot)
            return
        plan = what_if_plan(model_file, micro_batch, context, precision, checkpointing, grad_accum, world_size,
                            sharding)
        bounded = bool(budget or gpu)
        device = make_fake_device(budget if bounded else str(1 << 50), gpu, margin)
        result = what_if(model_file, plan, device, bounded=bounded, headroom=headroom, steps=steps)
        write_snapshot(memory_snapshot, model_file, plan, device, steps)
        render_what_if(result, plan, no_bf16_note(device, plan.precision), as_json)
