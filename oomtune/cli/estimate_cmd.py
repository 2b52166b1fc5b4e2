"""`oomtune estimate`: the probe's ladder on the fake device, no GPU needed; or, with --micro-batch, one plan."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from ..config.schema import HEADROOM, TRIAL_STEPS
from . import app
from .console import compiled, err, fmt_bytes, out
from .guard import stop_if_interrupted, user_errors
from .model_options import (
    DtypeOpt,
    LoraAlphaOpt,
    LoraDropoutOpt,
    LoraROpt,
    LoraTargetsOpt,
    ModelArg,
    ModelArgOpt,
    PaddingOpt,
    TaskOpt,
    model_source,
)
from .options import (
    AmpOpt,
    BatchOpt,
    CompileOpt,
    DebugOpt,
    GpuOpt,
    HeadroomOpt,
    JsonOpt,
    LeversOpt,
    MarginOpt,
    MinContextOpt,
    SnapshotOpt,
    StepsOpt,
    budget_option,
)
from .render import (
    breakdown_table,
    print_levers,
    render_search,
    render_what_if,
    savings_table,
    snapshot_written,
    trial_progress,
)

EstimateContextOpt = Annotated[int | None, typer.Option("--context", "-t", help="Target context length T (with "
                                                        "--micro-batch: the plan's context). Default: DEFAULTS, "
                                                        "else 512.")]
EstimateObjectiveOpt = Annotated[str, typer.Option(help="fit: the first rung that fits the whole batch at the "
                                                   "target context, else the largest plan at the longest context. "
                                                   "(throughput needs measured speed: use probe.)")]
MicroBatchOpt = Annotated[int | None, typer.Option("--micro-batch", help="Estimate this one plan instead of running "
                                                   "the ladder: its breakdown, and whether it fits.")]
PrecisionOpt = Annotated[str | None, typer.Option("--precision", help="With --micro-batch: fp32 | bf16 | fp16 "
                                                  "| bf16-true (default fp32).")]
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


BreakdownOpt = Annotated[bool, typer.Option("--breakdown", help="Also say what each lever of the plan saves: the plan "
                                            "estimated again with that lever off, the others on (one more estimate "
                                            "a lever).")]


def _told(label: str) -> None:
    err.print(f"  the plan without {escape(label)}: estimating")


def _ladder(job, gpu: str | None, as_json: bool, savings: bool = False) -> None:
    from ..config.writing import to_dict

    device, targets, world_size = job.device, job.targets, job.options["world_size"]
    if not as_json:  # (--json has them in its JSON)
        for note in job.notes:
            err.print(f"[yellow]note:[/] {escape(note)}")
    # the header and the trials on stderr, with --json too: its stdout holds the JSON alone
    ranks = f" x {world_size} ranks" if world_size > 1 else ""
    err.print(f"estimating [bold]{job.model_file.label}[/] for {device.name}{ranks}, budget "
              f"{fmt_bytes(device.budget_bytes)} (fake tensors: nothing runs on a GPU): batch {targets.batch}, "
              f"context {targets.context}"
              + (f" (min {targets.min_context})" if targets.min_context < targets.context else "") + compiled(job))
    err.print(f"  {escape(card_line(device, gpu))}")
    with trial_progress(device) as (on_start, on_trial):
        result = job.run(on_start, on_trial)
    stop_if_interrupted()  # a Ctrl-C during the search writes nothing, even one Python dropped
    kept = job.write(result, before_writing=stop_if_interrupted)  # (the snapshot's trial runs first)
    saved = job.savings(result, _told) if savings else None  # (after the config is written: nothing waits on it)
    snapshot_written(job.snapshot, result.breakdown_plan)
    extra = {"estimated": True, "margin": device.margin.describe(), "card": device.name.removesuffix(" (estimated)"),
             "card_profile": card_line(device, gpu),  # (the card's name alone in "card", as the what-if's JSON)
             "breakdown": to_dict(result.breakdown),
             "breakdown_plan": to_dict(result.breakdown_plan), "levers": result.levers,
             **({"savings": to_dict(saved)} if saved is not None else {})}

    def details():
        title = "breakdown" if result.config is not None else "breakdown of the smallest plan"
        out.print(breakdown_table(result.breakdown, result.breakdown_plan, result.search.limit_bytes, title,
                                  result.search.static.optimizer_name))
        if saved is not None:
            out.print(savings_table(saved, result.breakdown))
        print_levers(result.levers, result.breakdown_plan)

    render_search(result.search, job.out if result.config else None, as_json, "estimate", extra, details,
                  kept_train=kept)


@app.command()
def estimate(
    model: ModelArg,
    budget: Annotated[str | None, budget_option("--gpu's memory; without --gpu, none: give one", "The GPU memory to "
                                                "fit in: 24GiB, 80GB; with --gpu at most the card's memory, and also "
                                                "a percentage of it (80%)")] = None,
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
    compile_: CompileOpt = False,
    micro_batch: MicroBatchOpt = None,
    precision: PrecisionOpt = None,
    checkpointing: CheckpointingOpt = None,
    grad_accum: GradAccumOpt = None,
    world_size: WorldSizeOpt = 1,
    sharding: ShardingOpt = None,
    out_path: Annotated[Path | None, typer.Option("--out", "-o", help="Where to write the ladder's config (default "
                                                  "best.yaml; with --micro-batch nothing is written).")] = None,
    memory_snapshot: SnapshotOpt = None,
    savings: BreakdownOpt = False,
    as_json: JsonOpt = False,
    task: TaskOpt = None, dtype: DtypeOpt = None, padding: PaddingOpt = False, lora_r: LoraROpt = None,
    lora_alpha: LoraAlphaOpt = None, lora_dropout: LoraDropoutOpt = None, lora_targets: LoraTargetsOpt = None,
    model_arg: ModelArgOpt = None,
    debug: DebugOpt = False,
):
    """Predict the ladder without a GPU: run it on fake tensors (no compute, same memory accounting).

    Example: [cyan]oomtune estimate model.py --gpu a100-80 --batch 64 --context 2048[/]

    What-if: [cyan]oomtune estimate model.py --budget 24GiB --micro-batch 8 --context 1024 --precision bf16
    --checkpointing[/]
    """
    with user_errors(debug, as_json, searches=True):
        from .. import api
        from ..errors import OomtuneError
        from ..search.options import check_estimate_options, check_what_if_options, with_compile
        from ..search.trial import imports_settled

        levers = with_compile(levers, compile_, one_plan=micro_batch is not None)
        source = model_source(model, task, dtype, padding, lora_r, lora_alpha, lora_dropout, lora_targets, model_arg)
        if not check_what_if_options(micro_batch, precision, checkpointing, grad_accum, batch, min_context):
            job = api.prepare_estimate(source, budget=budget, gpu=gpu, margin=margin, batch=batch, context=context,
                                       min_context=min_context, headroom=headroom, steps=steps, objective=objective,
                                       amp=amp, levers=levers, world_size=world_size, sharding=sharding,
                                       out=out_path or Path("best.yaml"), memory_snapshot=memory_snapshot,
                                       header=f"written by `oomtune estimate {model}`: predicted on fake tensors, "
                                              "never measured on a GPU (check it with `oomtune probe` there) - edit "
                                              "`train:` freely")
            imports_settled()
            _ladder(job, gpu, as_json, savings)
            return
        check_estimate_options(objective, headroom, steps, amp)  # options the one plan ignores, still checked
        if out_path is not None:
            raise OomtuneError(f"--out {out_path}: with --micro-batch, estimate writes no config (the plan is yours "
                               "already; drop --out, or run the ladder without --micro-batch to write one)")
        result = api.what_if(source, micro_batch, context=context, precision=precision, checkpointing=checkpointing,
                             grad_accum=grad_accum, budget=budget, gpu=gpu, margin=margin, headroom=headroom,
                             steps=steps, world_size=world_size, sharding=sharding, memory_snapshot=memory_snapshot,
                             before_writing=stop_if_interrupted, levers=levers, savings=savings,
                             on_lever=_told)
        snapshot_written(memory_snapshot, result.plan)
        render_what_if(result, as_json)
