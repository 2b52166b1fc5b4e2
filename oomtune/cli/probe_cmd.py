"""`oomtune probe` and the rendering of a ladder search (shared with `estimate`)."""

from __future__ import annotations

import dataclasses
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..plan import HEADROOM, TRIAL_STEPS
from . import (
    RESULT_SHORT,
    RESULT_STYLE,
    DebugOpt,
    app,
    err,
    fmt_bytes,
    out,
    stop_if_interrupted,
    user_errors,
    worker_rank,
)
from .train_cmd import (
    DistTimeoutOpt,
    MasterAddrOpt,
    MasterPortOpt,
    NnodesOpt,
    NodeRankOpt,
    NprocOpt,
    flags,
    launch_ranks,
)


def rung_label(rung: str, precision: str) -> str:
    return {"fp32": "fp32", "amp": precision, "checkpointing": f"{precision}+ckpt",
            "fsdp": f"{precision}+fsdp"}.get(rung, rung)


def trials_table(records) -> Table:
    table = Table(title="trials", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col, just in (("#", "right"), ("rung", "left"), ("stage", "left"), ("batch", "right"),
                      ("ctx", "right"), ("result", "left"), ("peak", "right"), ("tok/s", "right"),
                      ("sec", "right")):
        table.add_column(col, justify=just, no_wrap=True)
    for i, r in enumerate(records, 1):
        accum = f"x{r.grad_accum_steps}" if r.grad_accum_steps > 1 else ""
        table.add_row(str(i), rung_label(r.rung, r.precision),
                      r.stage, f"{r.micro_batch_size}{accum}", str(r.context_length),
                      f"[{RESULT_STYLE[r.result]}]{RESULT_SHORT[r.result]}[/]", fmt_bytes(r.peak_bytes),
                      f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "-", f"{r.seconds:.2f}")
    return table


def rungs_table(ladder, targets, world_size: int = 1) -> Table:
    table = Table(title="ladder", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("rung", "best context", "best micro-batch" + (" per rank" if world_size > 1 else ""), "trials"):
        table.add_column(col, no_wrap=True)
    for r in ladder.rungs:
        table.add_row(rung_label(r.rung.name, r.rung.precision),
                      f"{r.context_length}/{targets.context}" if r.found else "[red]none[/]",
                      f"{r.micro_batch_size}/{targets.batch // world_size}" if r.found else "-", str(r.trials))
    return table


@contextmanager
def trial_progress(enabled: bool):
    """A spinner with the trial in flight; each finished trial is printed above it (stderr)."""
    if not enabled:
        yield (lambda point: None), (lambda rec: stop_if_interrupted())
        return
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TextColumn("[dim]{task.completed} trials"),
                        TimeElapsedColumn(), console=err, transient=True)
    task = progress.add_task("starting", total=None)

    def on_start(point):
        ck = " + checkpointing" if point.rung.activation_checkpointing else ""
        ck += f" + {point.rung.sharding}" if point.rung.sharding != "none" else ""
        accum = f" x{point.grad_accum_steps} accum" if point.grad_accum_steps > 1 else ""
        progress.update(task, description=f"{point.rung.precision}{ck}: micro-batch {point.micro_batch_size}, "
                                          f"context {point.context_length}{accum}")

    def on_trial(rec):
        stop_if_interrupted()
        progress.advance(task)
        progress.console.print(
            f"  [dim]{rec.rung:<13}[/] b={rec.micro_batch_size:<4} T={rec.context_length:<6} "
            f"[{RESULT_STYLE[rec.result]}]{RESULT_SHORT[rec.result]:<6}[/] {fmt_bytes(rec.peak_bytes):>10}"
        )

    with progress:
        yield on_start, on_trial


def check_out(out_path: Path, model: Path):
    """--out, checked before a single trial runs (and again just before writing): not the model file; absent or an
    oomtune config (never a folder, a device, a pipe, nor a file of yours that is anything else); in a folder that
    exists or can be made, and can be written. Returns the train: section of the config already there, which the
    new config keeps (None when there is none)."""
    from ..errors import OomtuneError
    from ..files import nearest_existing, try_write_in
    from ..plan import load_config

    p = Path(out_path)
    try:
        if p.resolve() == model.resolve() or (p.exists() and model.exists() and os.path.samefile(p, model)):
            raise OomtuneError(f"--out {p} is the model file: the config needs another name (e.g. --out best.yaml)")
        if p.is_dir():
            raise OomtuneError(f"--out {p} is a folder: name a file in it (e.g. --out {p / 'best.yaml'})")
        if p.exists() and not p.is_file():
            raise OomtuneError(f"--out {p} is not a regular file (a device, pipe or socket): name a file")
        train = None
        if p.exists():
            try:
                train = load_config(p).train
            except (OomtuneError, ValueError) as e:  # not YAML, not a config, not text
                why = str(e).removeprefix(f"{p}: ")
                raise OomtuneError(f"--out {p} exists and is not an oomtune config ({why}): not overwriting it; "
                                   "choose another --out or move it away") from None
            except OSError as e:
                raise OomtuneError(f"--out {p} exists and cannot be read ({e.strerror or e})") from None
        folder = nearest_existing(p.absolute().parent)  # written with its missing folders made
        if not folder.is_dir():
            raise OomtuneError(f"--out {p}: {folder} is not a folder")
        try_write_in(folder)  # what the write will do
    except OSError as e:
        raise OomtuneError(f"--out {p}: cannot write there ({e.strerror or e})") from None
    return train


def write_config(config, out_path: Path, model: Path, header: str) -> bool:
    """Write the config to --out, keeping the train: section of the oomtune config already there (read again now:
    it may have been edited while the search ran), its new plan and found_by replacing the old. True: it kept one."""
    from ..errors import OomtuneError
    from ..plan import save_config

    stop_if_interrupted()  # a Ctrl-C during the search writes nothing, even one Python dropped
    train = check_out(out_path, model)
    try:
        save_config(config if train is None else dataclasses.replace(config, train=train), out_path, header=header)
    except OSError as e:  # a full disk, a folder that went away or turned read-only during the search
        raise OomtuneError(f"cannot write the config to {out_path}: {e.strerror or e}") from None
    return train is not None


def divisor_note(result) -> str | None:
    """Where the global batch has no divisor near the largest micro-batch that fits (B=17 with 8 fitting runs as
    1 x 17), say so and name the nearest global batch that would run at the micro-batch that fits."""
    ladder = result.ladder
    if result.config is None or ladder.choice is None:
        return None
    fitting = next((r.micro_batch_size for r in ladder.rungs if r.rung == ladder.choice.rung and r.found), None)
    chosen = ladder.choice.micro_batch_size
    if fitting is None or chosen * 2 > fitting:  # within a factor of two of what fits: nothing to say
        return None
    world = result.world_size
    batch = result.targets.batch
    nearest = max(fitting, round(batch / world / fitting) * fitting) * world
    return (f"micro-batch {fitting} fits, but the global batch {batch} has no divisor between {chosen + 1} and "
            f"{fitting}{' per rank' if world > 1 else ''}: it runs as {chosen} x {ladder.choice.grad_accum_steps}; "
            f"--batch {nearest} would run as {fitting} x {nearest // world // fitting}")


def result_json(result, config_path: Path | None) -> dict:
    from ..plan import to_dict

    cfg = result.config
    return {
        "fits": cfg is not None,
        "plan": to_dict(cfg.plan) if cfg else None,
        "peak_bytes": cfg.found_by.peak_bytes if cfg else None,
        "tokens_per_s": cfg.found_by.tokens_per_s if cfg else None,
        "budget_bytes": result.budget_bytes,
        "limit_bytes": result.limit_bytes,
        "static": {"weights_bytes": result.static.weights_bytes, "gradients_bytes": result.static.gradients_bytes,
                   "optimizer_bytes": result.static.optimizer_bytes},
        "rungs": [{"rung": r.rung.name, "precision": r.rung.precision,
                   "activation_checkpointing": r.rung.activation_checkpointing,
                   "context_length": r.context_length, "micro_batch_size": r.micro_batch_size, "trials": r.trials}
                  for r in result.ladder.rungs],
        "trials": [to_dict(t) for t in result.records],
        "config_path": str(config_path) if config_path else None,
        "why_nothing_fits": result.why_nothing_fits,
        "divisor_note": divisor_note(result),
    }


def render_search(result, out_path: Path | None, as_json: bool, verb: str, extra_json: dict | None = None,
                  details=None, kept_train: bool = False) -> None:
    """Shared by probe and estimate: the tables, the plan, where it was written; exit 1 if nothing fits.
    estimate adds keys to the JSON (`extra_json`) and prints its breakdown after the tables (`details()`).
    `kept_train`: the config already at out_path was an oomtune config, and its train: section was kept."""
    if as_json:
        print(json.dumps(result_json(result, out_path) | {"kept_train": kept_train} | (extra_json or {}), indent=2))
    else:
        if result.records:  # none when the estimate knew without a trial that nothing fits
            out.print(trials_table(result.records))
            out.print(rungs_table(result.ladder, result.targets, result.world_size))
        if result.config is not None:
            fb = result.config.found_by
            tps = f", {fb.tokens_per_s:,.0f} tokens/s" if fb.tokens_per_s else ""
            out.print(f"[bold green]plan:[/] {result.config.plan.describe()}")
            out.print(f"      peak {fmt_bytes(fb.peak_bytes)} of {fmt_bytes(result.limit_bytes)} allowed "
                      f"(budget {fmt_bytes(fb.budget_bytes)}, {fb.headroom:.0%} headroom){tps}; "
                      f"{len(result.records)} trials")
            out.print(f"[bold]wrote[/] {out_path}   next: [cyan]oomtune train --config {out_path}[/]")
            note = divisor_note(result)
            if note:
                out.print(f"[yellow]note:[/] {note}")
            if kept_train:
                out.print(f"      kept the [bold]train:[/] section {out_path} already had (the plan and found_by "
                          "are new)")
        if details is not None:
            details()
    if result.config is None:
        err.print(f"[bold red]{verb}:[/] {result.why_nothing_fits}")
        raise typer.Exit(1)


@app.command()
def probe(
    model: Annotated[Path, typer.Argument(help="Your model file (build_model, make_batch, optional hooks).")],
    batch: Annotated[int | None, typer.Option("--batch", "-b", help="Target global batch B (kept exact). "
                                              "Default: the model file's DEFAULTS, else 32.")] = None,
    context: Annotated[int | None, typer.Option("--context", "-t", help="Target context length T. "
                                                "Default: DEFAULTS, else 512.")] = None,
    min_context: Annotated[int | None, typer.Option("--min-context", help="Shortest context you accept "
                                                    "(default: T, i.e. never cut).")] = None,
    device: Annotated[str, typer.Option("--device", "-d", help="auto | cuda | cpu | fake (cpu simulates a "
                                        "GPU's memory limit with a tensor-level tracker; fake does the same on "
                                        "fake tensors, computing nothing).")] = "auto",
    budget: Annotated[str | None, typer.Option("--budget", help="Memory to fit in: 24GiB, 512MiB, 80% "
                                               "(default: the GPU's free memory; cpu: available RAM).")] = None,
    headroom: Annotated[float, typer.Option(help="Fraction of the budget kept free.")] = HEADROOM,
    steps: Annotated[int, typer.Option(help="Optimizer steps per trial (2: optimizer state exists).")] = TRIAL_STEPS,
    objective: Annotated[str, typer.Option(help="fit: the first rung that fits; throughput: the fastest "
                                           "fitting rung (measures them all).")] = "fit",
    amp: Annotated[str, typer.Option(help="Mixed precision for the amp rungs: auto (bf16 where supported, "
                                     "else fp16) | bf16 | fp16.")] = "auto",
    out_path: Annotated[Path, typer.Option("--out", "-o", help="Where to write the config.")] = Path("best.yaml"),
    as_json: Annotated[bool, typer.Option("--json/--no-json", help="Print the result as JSON (for CI).")] = False,
    nproc_per_node: NprocOpt = None,
    nnodes: NnodesOpt = 1,
    node_rank: NodeRankOpt = 0,
    master_addr: MasterAddrOpt = "127.0.0.1",
    master_port: MasterPortOpt = None,
    dist_timeout: DistTimeoutOpt = 300.0,
    debug: DebugOpt = False,
):
    """Probe MODEL on a device: climb batch/context -> amp -> checkpointing -> accumulation until it fits.

    Example: [cyan]oomtune probe examples/tiny_gpt.py --device cpu --budget 12MiB[/]

    On several GPUs: [cyan]oomtune probe model.py --nproc-per-node 4[/] (all ranks run each trial; +fsdp rung).
    """
    with user_errors(debug):
        from ..devices import make_device
        from ..model_file import load_model_file
        from ..probe import check_search_options, resolve_targets
        from ..probe import probe as run_probe

        check_search_options(headroom, steps, objective, amp)  # before anything is loaded or run
        rank = worker_rank()
        if rank in (None, 0):  # the launcher and rank 0, which writes it
            check_out(out_path, model)
        model_file = load_model_file(model)
        targets = resolve_targets(model_file, batch, context, min_context)
        if nproc_per_node is not None and rank is None:  # the launcher: check, then the same probe on every rank
            from ..errors import OomtuneError
            from ..launch import Launch

            launch = Launch(nproc_per_node, nnodes, node_rank, master_addr, master_port)
            launch.check()
            if targets.batch % launch.world_size:
                raise OomtuneError(f"--batch {targets.batch} is not a multiple of the {launch.world_size} ranks: "
                                   "the global batch is shared out evenly")
            launch_ranks(["probe", str(model), *flags(batch=batch, context=context, min_context=min_context,
                                                      device=device, budget=budget, headroom=headroom, steps=steps,
                                                      objective=objective, amp=amp, out=out_path, json=as_json,
                                                      dist_timeout=dist_timeout, debug=debug)],
                         nproc_per_node, nnodes, node_rank, master_addr, master_port)
            return
        dist = None
        if rank is not None:
            import torch

            from .. import parallel

            kind = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
            dist = parallel.init(kind, "ddp", dist_timeout)  # cuda: picks this rank's GPU
        dev = make_device(device, budget)
        if rank not in (None, 0):  # every rank probes; rank 0 reports and writes the config
            result = run_probe(model_file, dev, targets, headroom=headroom, steps=steps, objective=objective,
                               amp=amp, dist=dist)
            if result.config is None:
                raise typer.Exit(1)
            return
        if not as_json:
            ranks = f" x {dist.world_size} ranks" if dist is not None else ""
            err.print(f"probing [bold]{model_file.label}[/] on {dev.name}{ranks}: batch {targets.batch}, "
                      f"context {targets.context}" + (f" (min {targets.min_context})"
                                                      if targets.min_context < targets.context else ""))
        with trial_progress(not as_json) as (on_start, on_trial):
            result = run_probe(model_file, dev, targets, headroom=headroom, steps=steps, objective=objective,
                               amp=amp, on_start=on_start, on_trial=on_trial, dist=dist)
        kept = result.config is not None and write_config(
            result.config, out_path, model, header=f"written by `oomtune probe {model}` — edit `train:` freely")
        render_search(result, out_path if result.config else None, as_json, "probe", kept_train=kept)
