"""`oomtune probe`: the ladder with real trials on a device (cuda, or the simulated cpu / fake ones)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..config.schema import HEADROOM, TRIAL_STEPS
from ..dist.launch import DEFAULT_TIMEOUT_S, worker_rank
from . import app
from .console import err
from .guard import stop_if_interrupted, user_errors
from .options import (
    AmpOpt,
    BatchOpt,
    ContextOpt,
    DebugOpt,
    DistTimeoutOpt,
    GpuOpt,
    HeadroomOpt,
    JsonOpt,
    LeversOpt,
    MasterAddrOpt,
    MasterPortOpt,
    MinContextOpt,
    ModelArg,
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
from .render import render_search, trial_progress, write_snapshot

PriorOpt = Annotated[bool | None, typer.Option("--prior/--no-prior", help="Estimate on fake tensors first, then "
                                               "certify each rung's boundary on the device (two trials a rung where "
                                               "the estimate is right; the search where it is off). --no-prior: the "
                                               "search alone. Default: --prior on cuda, --no-prior on cpu.")]
ObjectiveOpt = Annotated[str, typer.Option(help="fit: the first rung that fits; throughput: the fastest fitting rung "
                                           "(measures them all).")]


def write_found(config, out_path: Path, model: Path, header: str) -> bool:
    """Write the search's config to --out (a Ctrl-C during the search writes nothing, even one Python dropped);
    True when the train: section of the config already there was kept."""
    from ..config.output import write_config

    stop_if_interrupted()
    return config is not None and write_config(config, out_path, model, header)


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
    headroom: HeadroomOpt = HEADROOM,
    steps: StepsOpt = TRIAL_STEPS,
    objective: ObjectiveOpt = "fit",
    prior: PriorOpt = None,
    amp: AmpOpt = "auto",
    levers: LeversOpt = None,
    out_path: OutOpt = Path("best.yaml"),
    memory_snapshot: SnapshotOpt = None,
    as_json: JsonOpt = False,
    nproc_per_node: NprocOpt = None,
    nnodes: NnodesOpt = 1,
    node_rank: NodeRankOpt = 0,
    master_addr: MasterAddrOpt = "127.0.0.1",
    master_port: MasterPortOpt = None,
    dist_timeout: DistTimeoutOpt = DEFAULT_TIMEOUT_S,
    debug: DebugOpt = False,
):
    """Probe MODEL on a device: climb batch/context -> amp -> checkpointing -> accumulation until it fits.

    Example: [cyan]oomtune probe examples/tiny_gpt.py --device cpu --budget 12MiB[/]

    On several GPUs: [cyan]oomtune probe model.py --nproc-per-node 4[/] (all ranks run each trial; +fsdp rung).
    """
    with user_errors(debug):
        from ..config.output import check_out
        from ..dist.launch import Launch, run
        from ..memory import snapshot
        from ..model_file import load_model_file
        from ..search.options import check_search_options, parse_levers, resolve_targets
        from ..search.probe import check_ranks_batch, probe_on_ranks
        from ..search.probe import probe as run_probe

        check_search_options(headroom, steps, objective, amp)  # before anything is loaded or run
        allowed = parse_levers(levers)
        rank = worker_rank()
        if rank in (None, 0):  # the launcher and rank 0, which writes it
            check_out(out_path, model)
        snapshot.check_path(memory_snapshot, on_ranks=nproc_per_node is not None or rank is not None)
        model_file = load_model_file(model)
        targets = resolve_targets(model_file, batch, context, min_context)
        if nproc_per_node is not None and rank is None:  # the launcher: check, then the same probe on every rank
            launch = Launch(nproc_per_node, nnodes, node_rank, master_addr, master_port)
            launch.check()
            check_ranks_batch(targets, launch.world_size)
            run(launch, ["probe", str(model), *flags(batch=batch, context=context, min_context=min_context,
                                                     device=device, budget=budget, gpu=gpu, headroom=headroom,
                                                     steps=steps,
                                                     objective=objective, amp=amp, levers=levers, out=out_path,
                                                     prior=prior is True, no_prior=prior is False,
                                                     json=as_json,
                                                     dist_timeout=dist_timeout, debug=debug)])
            return
        dev, dist = probe_on_ranks(device, budget, dist_timeout, rank is not None, gpu)
        options = {"headroom": headroom, "steps": steps, "objective": objective, "amp": amp, "dist": dist,
                   "levers": allowed, "prior": prior}
        if rank not in (None, 0):  # every rank probes; rank 0 reports and writes the config
            if run_probe(model_file, dev, targets, **options).config is None:
                raise typer.Exit(1)
            return
        if not as_json:
            ranks = f" x {dist.world_size} ranks" if dist.grouped else ""
            err.print(f"probing [bold]{model_file.label}[/] on {dev.name}{ranks}: batch {targets.batch}, "
                      f"context {targets.context}" + (f" (min {targets.min_context})"
                                                      if targets.min_context < targets.context else ""))
        with trial_progress(not as_json) as (on_start, on_trial):
            result = run_probe(model_file, dev, targets, on_start=on_start, on_trial=on_trial, **options)
        kept = write_found(result.config, out_path, model,
                           header=f"written by `oomtune probe {model}` — edit `train:` freely")
        write_snapshot(memory_snapshot, model_file, result.plan, dev, steps)
        render_search(result, out_path if result.config else None, as_json, "probe", kept_train=kept)
