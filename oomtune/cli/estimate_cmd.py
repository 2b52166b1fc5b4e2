"""`oomtune estimate` (the probe's ladder on the fake device, no GPU needed) and `oomtune check` (CI: does a
config's plan still fit?)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from ..plan import HEADROOM, TRIAL_STEPS
from . import DebugOpt, app, err, fmt_bytes, out, user_errors
from .probe_cmd import check_out, render_search, trial_progress, write_config

MARGIN_HELP = ("Added to the tensor peak for what a real GPU needs beyond tensors: a fixed part (CUDA context, "
               "cuBLAS/cuDNN workspaces) + a percentage of the peak (allocator rounding, fragmentation). "
               "Default 512MiB+5%; 0 turns it off.")


def breakdown_table(bd, plan, limit_bytes: int | None = None, title: str = "breakdown") -> Table:
    from ..breakdown import PART_HELP, PART_LABELS

    table = Table(title=f"{title}: peak in {bd.phase} - {plan.describe()}", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for col, just in (("part", "left"), ("bytes", "right"), ("share", "right"), ("what", "left")):
        table.add_column(col, justify=just, no_wrap=col != "what")
    peak = bd.tensor_peak_bytes or 1
    for name, n in bd.part_bytes().items():
        table.add_row(PART_LABELS[name], fmt_bytes(n), f"{n / peak:.0%}", f"[dim]{PART_HELP[name]}[/]")
    table.add_section()
    table.add_row("[bold]tensor peak[/]", f"[bold]{fmt_bytes(bd.tensor_peak_bytes)}[/]", "", "[dim]the parts' sum[/]")
    table.add_row(f"+ margin {bd.margin}", fmt_bytes(bd.margin_bytes), "",
                  "[dim]CUDA context, workspaces, allocator rounding (--margin)[/]")
    style = "" if limit_bytes is None else ("green" if bd.peak_bytes <= limit_bytes else "red")
    table.add_row("[bold]peak[/]", f"[bold {style}]{fmt_bytes(bd.peak_bytes)}[/]" if style else
                  f"[bold]{fmt_bytes(bd.peak_bytes)}[/]", "", "")
    if limit_bytes is not None:
        table.add_row("allowed", fmt_bytes(limit_bytes), "", "[dim]budget less headroom[/]")
    return table


def no_bf16_note(device, precision: str | None) -> str | None:
    """bf16 asked for on a card without it: the memory is the same, the speed is not."""
    if device is None or precision != "bf16" or device.supports_bf16():
        return None
    card = device.name.removesuffix(" (estimated)")
    return (f"{card} has no native bf16 (compute capability below 8.0): PyTorch emulates it, without fp16's "
            "tensor-core speed. The memory estimate holds; fp16 (--amp auto picks it there) is the card's mixed "
            "precision.")


def print_levers(levers, plan) -> None:
    if levers:
        out.print(f"[bold]what would help[/] {plan.describe()} fit (estimates):")
        for lever in levers:
            out.print(f"  - {lever}")


def _plan_mode_options(micro_batch, precision, checkpointing, grad_accum, batch, min_context) -> bool:
    from ..errors import OomtuneError
    from ..plan import PRECISIONS

    plan_opts = {"--precision": precision, "--checkpointing": checkpointing, "--grad-accum": grad_accum}
    if micro_batch is None:
        given = [k for k, v in plan_opts.items() if v is not None]
        if given:
            raise OomtuneError(f"{', '.join(given)} describe one plan: give --micro-batch too "
                               "(without them estimate runs the whole ladder)")
        return False
    for name, v in (("--batch", batch), ("--min-context", min_context)):
        if v is not None:
            raise OomtuneError(f"{name} is a ladder target; with --micro-batch the plan is --micro-batch x "
                               "--grad-accum at --context")
    if precision is not None and precision not in PRECISIONS:
        raise OomtuneError(f"--precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    for name, v in (("--micro-batch", micro_batch), ("--grad-accum", grad_accum)):
        if v is not None and v < 1:
            raise OomtuneError(f"{name} must be at least 1, got {v}")
    return True


@app.command()
def estimate(
    model: Annotated[Path, typer.Argument(help="Your model file (build_model, make_batch, optional hooks).")],
    budget: Annotated[str | None, typer.Option("--budget", help="The GPU memory to fit in: 24GiB, 80GB; with "
                                               "--gpu also a percentage (80%).")] = None,
    gpu: Annotated[str | None, typer.Option("--gpu", help="A card from the table: t4, rtx3060, rtx3090, rtx4090, "
                                            "l4, a10, a100-40, a100-80, h100, h200 (memory; bf16 support).")] = None,
    margin: Annotated[str | None, typer.Option("--margin", help=MARGIN_HELP)] = None,
    batch: Annotated[int | None, typer.Option("--batch", "-b", help="Target global batch B (kept exact). "
                                              "Default: the model file's DEFAULTS, else 32.")] = None,
    context: Annotated[int | None, typer.Option("--context", "-t", help="Target context length T (with "
                                                "--micro-batch: the plan's context).")] = None,
    min_context: Annotated[int | None, typer.Option("--min-context", help="Shortest context you accept "
                                                    "(default: T, i.e. never cut).")] = None,
    headroom: Annotated[float, typer.Option(help="Fraction of the budget kept free.")] = HEADROOM,
    steps: Annotated[int, typer.Option(help="Optimizer steps per trial (2: optimizer state exists).")] = TRIAL_STEPS,
    objective: Annotated[str, typer.Option(help="fit: the first rung that fits. (throughput needs measured "
                                           "speed: use probe.)")] = "fit",
    amp: Annotated[str, typer.Option(help="Mixed precision for the amp rungs: auto (bf16 where the card has it, "
                                     "else fp16) | bf16 | fp16.")] = "auto",
    micro_batch: Annotated[int | None, typer.Option("--micro-batch", help="Estimate this one plan instead of "
                                                    "running the ladder: its breakdown, and whether it fits.")] = None,
    precision: Annotated[str | None, typer.Option("--precision", help="With --micro-batch: fp32 | bf16 | fp16 "
                                                  "(default fp32).")] = None,
    checkpointing: Annotated[bool | None, typer.Option("--checkpointing/--no-checkpointing", help="With "
                                                       "--micro-batch: activation checkpointing.")] = None,
    grad_accum: Annotated[int | None, typer.Option("--grad-accum", help="With --micro-batch: accumulation "
                                                   "steps (default 1).")] = None,
    world_size: Annotated[int, typer.Option("--world-size", help="Ranks (GPUs) to plan for: the per-rank peak is "
                                            "measured on rank 0 of a fake process group.")] = 1,
    sharding: Annotated[str | None, typer.Option("--sharding", help="none | ddp | fsdp: every rung on this (default: "
                                                 "ddp rungs, then an fsdp rung, on several ranks).")] = None,
    out_path: Annotated[Path, typer.Option("--out", "-o", help="Where to write the config.")] = Path("best.yaml"),
    as_json: Annotated[bool, typer.Option("--json/--no-json", help="Print the result as JSON (for CI).")] = False,
    debug: DebugOpt = False,
):
    """Predict the ladder without a GPU: run it on fake tensors (no compute, same memory accounting).

    Example: [cyan]oomtune estimate model.py --gpu a100-80 --batch 64 --context 2048[/]

    What-if: [cyan]oomtune estimate model.py --budget 24GiB --micro-batch 8 --context 1024 --precision bf16
    --checkpointing[/]
    """
    with user_errors(debug):
        from ..breakdown import static_memory
        from ..estimate import check_estimate_options, make_fake_device, what_if
        from ..estimate import estimate as run_estimate
        from ..gpus_table import parse_margin
        from ..model_file import load_model_file
        from ..parallel import check_world
        from ..plan import Plan, to_dict
        from ..probe import resolve_targets

        plan_mode = _plan_mode_options(micro_batch, precision, checkpointing, grad_accum, batch, min_context)
        check_estimate_options(objective, headroom, steps, amp)  # both modes, before anything is loaded
        check_world(world_size, sharding)
        if not plan_mode:  # the ladder writes --out: check it before the search, not after
            check_out(out_path, model)
        model_file = load_model_file(model)
        if plan_mode:
            targets = resolve_targets(model_file, None, context, None)
            plan = Plan(micro_batch, targets.context, precision or "fp32", bool(checkpointing),
                        grad_accum if grad_accum is not None else 1,
                        world_size=world_size, sharding=sharding or ("ddp" if world_size > 1 else "none"))
            device = make_fake_device(budget, gpu, margin) if (budget or gpu) else None
            if plan.activation_checkpointing and not static_memory(model_file).checkpointing_supported:
                from ..errors import OomtuneError

                raise OomtuneError(f"{model_file.label}: --checkpointing, but no blocks to wrap (define blocks(model))")
            result = what_if(model_file, plan, device, device.margin if device else parse_margin(margin),
                             headroom=headroom, steps=steps)
            note = no_bf16_note(device, plan.precision)
            if as_json:
                print(json.dumps({"estimated": True, "plan": to_dict(plan), "fits": result.fits,
                                  "budget_bytes": result.budget_bytes, "limit_bytes": result.limit_bytes,
                                  "breakdown": to_dict(result.breakdown), "levers": list(result.levers),
                                  **({"note": note} if note else {})}, indent=2))
            else:
                if note:
                    err.print(f"[yellow]note:[/] {escape(note)}")
                out.print(breakdown_table(result.breakdown, plan, result.limit_bytes, "estimate"))
                if result.fits is not None:
                    verdict = "[bold green]fits[/]" if result.fits else "[bold red]does not fit[/]"
                    out.print(f"{verdict}: peak {fmt_bytes(result.breakdown.peak_bytes)} vs "
                              f"{fmt_bytes(result.limit_bytes)} allowed (budget {fmt_bytes(result.budget_bytes)}, "
                              f"{headroom:.0%} headroom)")
                    print_levers(result.levers, plan)
            if result.fits is False:
                raise typer.Exit(1)
            return

        targets = resolve_targets(model_file, batch, context, min_context)
        device = make_fake_device(budget, gpu, margin)
        note = no_bf16_note(device, amp)
        if note and not as_json:
            err.print(f"[yellow]note:[/] {escape(note)}")
        if not as_json:
            ranks = f" x {world_size} ranks" if world_size > 1 else ""
            err.print(f"estimating [bold]{model_file.label}[/] for {device.name}{ranks}, budget "
                      f"{fmt_bytes(device.budget_bytes)} (fake tensors: nothing runs on a GPU; margin "
                      f"{device.margin.describe()}): batch {targets.batch}, context {targets.context}"
                      + (f" (min {targets.min_context})" if targets.min_context < targets.context else ""))
        with trial_progress(not as_json) as (on_start, on_trial):
            result = run_estimate(model_file, device, targets, headroom=headroom, steps=steps, objective=objective,
                                  amp=amp, on_start=on_start, on_trial=on_trial, world_size=world_size,
                                  sharding=sharding)
        kept = result.config is not None and write_config(
            result.config, out_path, model,
            header=f"written by `oomtune estimate {model}`: predicted on fake tensors, never measured on a GPU "
                   "(check it with `oomtune probe` there) - edit `train:` freely")
        extra = {"estimated": True, "margin": device.margin.describe(), "breakdown": to_dict(result.breakdown),
                 "breakdown_plan": to_dict(result.breakdown_plan), "levers": result.levers}

        def details():
            title = "breakdown" if result.config is not None else "breakdown of the smallest plan"
            out.print(breakdown_table(result.breakdown, result.breakdown_plan, result.search.limit_bytes, title))
            print_levers(result.levers, result.breakdown_plan)

        render_search(result.search, out_path if result.config else None, as_json, "estimate", extra, details,
                      kept_train=kept)


@app.command()
def check(
    config_path: Annotated[Path, typer.Option("--config", "-c", help="The config to check (from probe or "
                                              "estimate).")],
    budget: Annotated[str | None, typer.Option("--budget", help="Memory to fit in (default: the config's "
                                               "found_by.budget_bytes).")] = None,
    device: Annotated[str, typer.Option("--device", "-d", help="fake (default: no GPU, estimated) | cpu "
                                        "(real compute, simulated memory) | cuda (the real GPU).")] = "fake",
    headroom: Annotated[float | None, typer.Option(help="Fraction of the budget kept free (default: the "
                                                   "config's).")] = None,
    margin: Annotated[str | None, typer.Option("--margin", help="fake device only. Default: the margin the "
                                               "config was estimated with; for a config probed on a GPU "
                                               "512MiB+5%; for one probed on cpu 0.")] = None,
    steps: Annotated[int, typer.Option(help="Optimizer steps to run (2: optimizer state exists).")] = TRIAL_STEPS,
    as_json: Annotated[bool, typer.Option("--json/--no-json", help="Print the result as JSON (for CI).")] = False,
    debug: DebugOpt = False,
):
    """CI gate: re-measure the config's plan; exit 0 if it still fits, 1 if it no longer does, 2 for bad input.

    Example: [cyan]oomtune check --config best.yaml[/]
    """
    with user_errors(debug):
        from ..estimate import check as run_check
        from ..model_file import load_model_file
        from ..plan import load_config, to_dict

        config = load_config(config_path)
        model_file = load_model_file(config.model_path(config_path))
        result = run_check(config, model_file, device_kind=device, budget=budget, headroom=headroom,
                           margin=margin, steps=steps)
        if as_json:
            print(json.dumps({
                "fits": result.fits, "device": result.device, "plan": to_dict(result.plan),
                "budget_bytes": result.budget_bytes, "headroom": result.headroom, "limit_bytes": result.limit_bytes,
                "old_peak_bytes": result.old_peak_bytes, "new_peak_bytes": result.new_peak_bytes,
                "old_breakdown": to_dict(result.old) if result.old else None,
                "new_breakdown": to_dict(result.new) if result.new else None,
                "difference": result.difference, "oom_message": result.oom_message,
                "budget_clamped_from_bytes": result.budget_clamped_from,
            }, indent=2))
        else:
            render_check(result, config_path)
        if not result.fits:
            raise typer.Exit(1)


def _delta(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{'+' if n > 0 else ''}{fmt_bytes(n)}" if n else "0"


def render_check(result, config_path: Path) -> None:
    from ..breakdown import PART_LABELS

    where = {"fake": "fake device (estimated)", "cpu": "cpu device", "cuda": "the GPU"}[result.device]
    out.print(f"checked [bold]{config_path}[/] on the {where}: {result.plan.describe()}")
    old, new = result.old_peak_bytes, result.new_peak_bytes
    grew = None if old is None or new is None else new - old
    out.print(f"  old peak  {fmt_bytes(old)}   (recorded in the config)")
    out.print(f"  new peak  {fmt_bytes(new) if new is not None else '[red]out of memory[/]'}"
              + (f"   ({_delta(grew)})" if grew is not None else ""))
    out.print(f"  allowed   {fmt_bytes(result.limit_bytes)}   (budget {fmt_bytes(result.budget_bytes)}, "
              f"{result.headroom:.0%} headroom)")
    if result.budget_clamped_from is not None:
        out.print(f"  [yellow]budget lowered[/] from the config's {fmt_bytes(result.budget_clamped_from)} to the "
                  f"{fmt_bytes(result.budget_bytes)} free on the GPU now (--budget sets it)")
    if result.new is not None:
        table = Table(title=f"breakdown (peak in {result.new.phase})", title_justify="left", box=box.SIMPLE_HEAD,
                      pad_edge=False)
        for col in ("part", "old", "new", "difference"):
            table.add_column(col, justify="left" if col == "part" else "right", no_wrap=True)
        diff = result.difference
        for name in PART_LABELS:
            o = result.old.part_bytes()[name] if result.old else None
            n = result.new.part_bytes()[name]
            table.add_row(PART_LABELS[name], fmt_bytes(o), fmt_bytes(n), _delta(diff[name]) if diff else "-")
        table.add_section()
        for label, key in (("tensor peak", "tensor_peak_bytes"), (f"margin {result.new.margin}", "margin_bytes"),
                           ("peak", "peak_bytes")):
            o = getattr(result.old, key) if result.old else None
            n = getattr(result.new, key)
            table.add_row(label, fmt_bytes(o), fmt_bytes(n), _delta(n - o) if o is not None else "-")
        out.print(table)
    if result.fits:
        out.print("[bold green]still fits[/]")
    else:
        reason = result.oom_message or (f"peak {fmt_bytes(new)} > {fmt_bytes(result.limit_bytes)} allowed")
        err.print(f"[bold red]no longer fits:[/] {reason}")
