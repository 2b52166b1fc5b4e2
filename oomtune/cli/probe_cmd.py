"""`oomtune probe`: the ladder with real trials on a device (cuda, or the simulated cpu / fake ones)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..config.schema import HEADROOM, TRIAL_STEPS
from ..dist.launch import DEFAULT_TIMEOUT_S, worker_rank
from . import app
from .console import compiled, err
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
    model_flags,
    model_source,
)
from .options import (
    AmpOpt,
    BatchOpt,
    CompileOpt,
    ContextOpt,
    DebugOpt,
    DistTimeoutOpt,
    GpuOpt,
    HeadroomOpt,
    JsonOpt,
    LeversOpt,
    MarginOpt,
    MasterAddrOpt,
    MasterPortOpt,
    MinContextOpt,
    NnodesOpt,
    NodeRankOpt,
    NprocOpt,
    OutOpt,
    SnapshotOpt,
    StepsOpt,
    budget_option,
    device_option,
)
from .ranks import flags
from .render import render_search, snapshot_written, trial_progress

PriorOpt = Annotated[bool | None, typer.Option("--prior/--no-prior", help="Estimate on fake tensors first, then "
                                               "certify each rung's boundary on the device (two trials a rung where "
                                               "the estimate is right; the search where it is off). --no-prior: the "
                                               "search alone. Default on cuda: the estimate where one trial timed on "
                                               "each says its fake trials cost less than the device trials they "
                                               "save; on cpu: --no-prior.")]
ObjectiveOpt = Annotated[str, typer.Option(help="fit: the first rung that fits the whole batch at the target "
                                           "context, else the largest plan at the longest context (the earlier rung on "
                                           "a tie); throughput: the fastest fitting rung (measures them all).")]


@app.command()
def probe(
    model: ModelArg,
    batch: BatchOpt = None,
    context: ContextOpt = None,
    min_context: MinContextOpt = None,
    device: Annotated[str, device_option("auto | cuda | cpu | fake (cpu simulates a GPU's memory limit with a "
                                         "tensor-level tracker; fake does the same on fake tensors, computing "
                                         "nothing).")] = "auto",
    budget: Annotated[str | None, budget_option("the GPU's free memory; cpu: available RAM; fake: --gpu's")] = None,
    gpu: GpuOpt = None,
    margin: MarginOpt = None,
    headroom: HeadroomOpt = HEADROOM,
    steps: StepsOpt = TRIAL_STEPS,
    objective: ObjectiveOpt = "fit",
    prior: PriorOpt = None,
    amp: AmpOpt = "auto",
    levers: LeversOpt = None,
    compile_: CompileOpt = False,
    out_path: OutOpt = Path("best.yaml"),
    memory_snapshot: SnapshotOpt = None,
    as_json: JsonOpt = False,
    nproc_per_node: NprocOpt = None,
    nnodes: NnodesOpt = 1,
    node_rank: NodeRankOpt = 0,
    master_addr: MasterAddrOpt = "127.0.0.1",
    master_port: MasterPortOpt = None,
    dist_timeout: DistTimeoutOpt = DEFAULT_TIMEOUT_S,
    task: TaskOpt = None, dtype: DtypeOpt = None, padding: PaddingOpt = False, lora_r: LoraROpt = None,
    lora_alpha: LoraAlphaOpt = None, lora_dropout: LoraDropoutOpt = None, lora_targets: LoraTargetsOpt = None,
    model_arg: ModelArgOpt = None,
    debug: DebugOpt = False,
):
    """Probe MODEL on a device: climb batch/context -> amp -> checkpointing -> accumulation until it fits.

    Example: [cyan]oomtune probe examples/tiny_gpt.py --device cpu --budget 12MiB[/]

    On several GPUs: [cyan]oomtune probe model.py --nproc-per-node 4[/] (all ranks run each trial; +fsdp rung).
    """
    with user_errors(debug, as_json, searches=True):
        from ..api import prepare_probe
        from ..dist.launch import Launch, run
        from ..search.options import with_compile
        from ..search.probe import check_ranks_batch

        levers = with_compile(levers, compile_)
        rank = worker_rank()
        source = model_source(model, task, dtype, padding, lora_r, lora_alpha, lora_dropout, lora_targets, model_arg)
        job = prepare_probe(source, batch=batch, context=context, min_context=min_context, device=device,
                            budget=budget, gpu=gpu, headroom=headroom, steps=steps, objective=objective, amp=amp,
                            levers=levers, prior=prior, margin=margin,
                            out=out_path if rank in (None, 0) else None,  # the launcher and rank 0, which writes it
                            memory_snapshot=memory_snapshot, on_ranks=nproc_per_node is not None or rank is not None,
                            header=f"written by `oomtune probe {model}` — edit `train:` freely")
        if nproc_per_node is not None and rank is None:  # the launcher: check, then the same probe on every rank
            launch = Launch(nproc_per_node, nnodes, node_rank, master_addr, master_port)
            launch.check()
            check_ranks_batch(job.targets, launch.world_size)
            run(launch, ["probe", model, *model_flags(source), *flags(
                batch=batch, context=context, min_context=min_context, device=device, budget=budget, gpu=gpu,
                margin=margin, headroom=headroom, steps=steps, objective=objective, amp=amp, levers=levers,
                out=out_path, prior=prior is True, no_prior=prior is False, json=as_json, dist_timeout=dist_timeout,
                debug=debug)])
            return
        job.connect(dist_timeout, launched=rank is not None)
        if rank not in (None, 0):  # every rank probes; rank 0 reports and writes the config
            if job.run().config is None:
                raise typer.Exit(1)
            return
        with trial_progress(job.device) as (on_start, on_trial):  # stderr: --json's stdout holds the JSON alone
            result = job.run(on_start, on_trial, on_begin=lambda estimating: _say_what_runs(
                job, estimating, no_gpu=device == "auto" and budget is None and gpu is None))
        stop_if_interrupted()  # a Ctrl-C during the search writes nothing, even one Python dropped
        kept = job.write(result, before_writing=stop_if_interrupted)  # (the snapshot's trial runs first)
        snapshot_written(memory_snapshot, result.plan)
        render_search(result, out_path if result.config else None, as_json, "probe", kept_train=kept)


def _say_what_runs(job, estimating: bool, no_gpu: bool = False) -> None:
    """The header (stderr, with --json too), once the input is checked (a budget below the weights is an error, not
    a probe that began).
    `no_gpu`: --device auto found none, and no --budget or --gpu said what memory to fit."""
    targets, dist = job.targets, job.dist
    ranks = f" x {dist.world_size} ranks" if dist.grouped else ""
    err.print(f"probing [bold]{job.model_file.label}[/] on {job.device.name}{ranks}: batch {targets.batch}, "
              f"context {targets.context}" + (f" (min {targets.min_context})"
                                              if targets.min_context < targets.context else "") + compiled(job))
    if no_gpu and job.device.kind == "cpu":
        err.print("  [yellow]no GPU found[/]: probing the CPU in this machine's free RAM, counting memory as its "
                  "kernels use it; for a GPU's plan add --gpu NAME (its memory, counted as CUDA does), or run "
                  "[cyan]oomtune estimate --gpu NAME[/]")
    elif job.device.kind == "cpu" and getattr(job.device, "card", None) is None:
        err.print("  [dim]counting memory as the CPU's kernels use it (math attention, CPU autocast); add --gpu NAME "
                  "(or generic) to count it as a CUDA card would[/]")
    if estimating:
        err.print("  [dim]estimating every rung on fake tensors first (no device memory), then certifying each "
                  "on the device[/]")
