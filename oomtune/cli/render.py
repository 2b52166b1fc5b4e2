"""What probe, estimate and check print: the trials, the ladder, the plan, the breakdown, the levers, check's
verdict; and --json. Rendering only: every number comes from the library's results. What imports torch is imported
where it is used, so that `oomtune --help` does not load it."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import typer
from rich import box
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..config.writing import to_dict
from ..units import counted
from .chart import peak_chart
from .console import RESULT_SHORT, RESULT_STYLE, err, fmt_bytes, out, rate_unit, rung_label
from .guard import print_json, stop_if_interrupted


def trials_table(records) -> Table:
    table = Table(title="trials", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    speed = rate_unit(1) if records and all(r.context_length == 1 for r in records) else rate_unit(2)
    for col, just in (("#", "right"), ("rung", "left"), ("stage", "left"), ("batch", "right"),
                      ("ctx", "right"), ("result", "left"), ("peak", "right"), (speed, "right"),
                      ("sec", "right")):
        table.add_column(col, justify=just, no_wrap=col != "rung", overflow="fold" if col == "rung" else "ellipsis")
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
        table.add_column(col, no_wrap=col != "rung", overflow="fold" if col == "rung" else "ellipsis")
    c = ladder.choice
    for r in ladder.rungs:
        # the plan's rung, where accumulation needed a shorter context than micro-batch 1 alone: that one too
        cut = f" ({c.context_length} x{c.grad_accum_steps})" if (c is not None and c.rung == r.rung and r.found and
                                                                 c.context_length < r.context_length) else ""
        table.add_row(rung_label(r.rung.name, r.rung.precision),
                      f"{r.context_length}/{targets.context}{cut}" if r.found else "[red]none[/]",
                      f"{r.micro_batch_size}/{targets.batch // world_size}{_with_accumulation(r)}" if r.found else "-",
                      str(r.trials))
    return table


def _with_accumulation(r) -> str:
    """A rung certified by its plan (from the prior): the micro-batch is the plan's, with that accumulation."""
    return f" x{r.grad_accum_steps} (plan)" if r.grad_accum_steps > 1 else ""


@contextmanager
def trial_progress(device=None):
    """A spinner with the trial in flight; each finished trial is printed above it (stderr). `device`: the fake
    device the trials run on, which may start computing (a model that needs tensor values): said once, when it
    does, as those trials are slower."""
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TextColumn("[dim]{task.completed} trials"),
                        TimeElapsedColumn(), console=err, transient=True)
    task = progress.add_task("starting", total=None)
    said: list[bool] = []

    def on_start(point):
        if device is not None and device.kind == "fake" and device.computes and not said:
            said.append(True)
            progress.console.print("[yellow]note:[/] the model needs tensor values, which fake tensors do not have: "
                                   "from here the trials are computed on the cpu (slower; up to the budget in RAM)")
        accum = f" x{point.grad_accum_steps} accum" if point.grad_accum_steps > 1 else ""
        progress.update(task, description=f"{point.rung.name}: micro-batch {point.micro_batch_size}, "
                                          f"context {point.context_length}{accum}")

    def on_trial(rec):
        stop_if_interrupted()
        progress.advance(task)
        # the rung last: the ladder's names run from "fp32" to "chunked-loss+bf16-true+8bit+...+offload-activations"
        b = f"{rec.micro_batch_size}x{rec.grad_accum_steps}" if rec.grad_accum_steps > 1 else rec.micro_batch_size
        progress.console.print(
            f"  b={b:<7} T={rec.context_length:<6} "
            f"[{RESULT_STYLE[rec.result]}]{RESULT_SHORT[rec.result]:<6}[/] {fmt_bytes(rec.peak_bytes):>11}  "
            f"[dim]{rung_label(rec.rung, rec.precision)}[/]"
        )

    with progress:
        yield on_start, on_trial


def result_json(result, config_path: Path | None) -> dict:
    from ..search.divisor_note import divisor_note

    cfg = result.config
    return {
        "fits": cfg is not None,
        "plan": to_dict(cfg.plan) if cfg else None,
        "peak_bytes": cfg.found_by.peak_bytes if cfg else None,
        "host_peak_bytes": cfg.found_by.host_peak_bytes if cfg else None,
        "tokens_per_s": cfg.found_by.tokens_per_s if cfg else None,
        "budget_bytes": result.budget_bytes,
        "limit_bytes": result.limit_bytes,
        "static": {"weights_bytes": result.static.weights_bytes, "gradients_bytes": result.static.gradients_bytes,
                   "optimizer_bytes": result.static.optimizer_bytes},
        "levers_not_used": dict(result.past.skipped) if result.past is not None else {},
        "rungs": [{"rung": r.rung.name, "precision": r.rung.precision,
                   "activation_checkpointing": r.rung.activation_checkpointing,
                   "context_length": r.context_length, "micro_batch_size": r.micro_batch_size,
                   "grad_accum_steps": r.grad_accum_steps, "trials": r.trials}
                  for r in result.ladder.rungs],
        "trials": [to_dict(t) for t in result.records],
        "config_path": str(config_path) if config_path else None,
        "why_nothing_fits": result.why_nothing_fits,
        "over_headroom": result.over_headroom.to_json() if result.over_headroom is not None else None,
        "divisor_note": divisor_note(result),
        "notes": list(result.notes),
        "prior": result.prior.to_json() if result.prior is not None else None,
    }


def snapshot_written(path, plan) -> None:
    """--memory-snapshot: where it went (the API writes one where there is a plan), and how to look at it."""
    if path is not None and plan is not None:
        err.print(f"wrote the memory snapshot {path} (view: python -m torch.cuda._memory_viz trace_plot {path} -o "
                  f"{path}.html)")


def found_text(records) -> str:
    """How the estimate's trials were found, where not all were run whole: " (3 replayed, 10 made from fewer
    blocks, 2 with the second step made from the first)"."""
    made = sum(r.source == "extrapolated" for r in records)
    replayed = sum(r.source == "replayed" for r in records)
    halves = sum(r.source == "first-step-run" for r in records)
    bounded = sum(r.source == "bounded" for r in records)
    parts = ([f"{replayed} replayed"] if replayed else []) + ([f"{made} made from fewer blocks"] if made else []) + \
        ([f"{halves} with the second step made from the first"] if halves else []) + \
        ([f"{bounded} out of memory since micro-batch 1 is"] if bounded else [])
    return f" ({', '.join(parts)})" if parts else ""


def prior_text(prior) -> str:
    """How the probe's trials were chosen: certified from a fake pre-estimate (its cost apart), or why not."""
    if prior is None:
        return ""
    if prior.missing is not None:
        return f" (no prior: {prior.missing})"
    off = f"; prior off, searched instead: {', '.join(prior.fell_back)}" if prior.fell_back else ""
    return (f" on the device, certified from an estimate on fake tensors ({prior.counts()}, "
            f"{prior.seconds:.1f} s){off}")


def render_search(result, out_path: Path | None, as_json: bool, verb: str, extra_json: dict | None = None,
                  details=None, kept_train: bool = False) -> None:
    """Shared by probe and estimate: the tables, the plan, where it was written; exit 1 if nothing fits (2 where the
    budget is under the weights, gradients and optimizer state: estimate's bad input).
    estimate adds keys to the JSON (`extra_json`) and prints its breakdown after the tables (`details()`).
    `kept_train`: the config already at out_path was an oomtune config, and its train: section was kept."""
    from ..search.divisor_note import divisor_note

    if as_json:
        report = result_json(result, out_path) | {"kept_train": kept_train} | (extra_json or {})
        print_json(json.dumps(report, indent=2))
    else:
        if result.records:  # none when the estimate knew without a trial that nothing fits
            out.print(trials_table(result.records))
            out.print(rungs_table(result.ladder, result.targets, result.world_size))
            chart = peak_chart(result.records, result.limit_bytes)
            if chart is not None:
                out.print(chart)
        if result.config is not None:
            fb = result.config.found_by
            unit = rate_unit(result.config.plan.context_length, long=True)
            tps = f", {fb.tokens_per_s:,.0f} {unit}" if fb.tokens_per_s else ""
            out.print(f"[bold green]plan:[/] {result.config.plan.describe()}")
            out.print(f"      peak {fmt_bytes(fb.peak_bytes)} of {fmt_bytes(result.limit_bytes)} allowed "
                      f"(budget {fmt_bytes(fb.budget_bytes)}, {fb.headroom:.0%} headroom){tps}; "
                      f"{counted(len(result.records), 'trial')}{found_text(result.records)}{prior_text(result.prior)}")
            if fb.host_peak_bytes:
                out.print(f"      host memory {fmt_bytes(fb.host_peak_bytes)} {host_use(result.config.plan)}"
                          + (" (estimated: check the machine has it free)" if fb.estimated else ""))
            out.print(f"[bold]wrote[/] {out_path}   next: [cyan]oomtune train --config {out_path}[/]")
            note = divisor_note(result)
            if note:
                out.print(f"[yellow]note:[/] {escape(note)}")
            if kept_train:
                out.print(f"      kept the [bold]train:[/] section {out_path} already had (the plan and found_by "
                          "are new)")
        for note in result.notes:
            out.print(f"[yellow]note:[/] {escape(note)}")
        if details is not None:
            details()
    if result.config is None:
        err.print(f"[bold red]{verb}:[/] {escape(result.why_nothing_fits)}")
        raise typer.Exit(2 if result.too_small else 1)  # a budget under the weights is bad input, as probe's


def host_use(plan) -> str:
    """What a plan's host memory is for: the offloaded parts, and an NF4 model's build (quantized after it)."""
    uses = ["for the offloaded parts"] if plan.offload_optimizer or plan.offload_activations else []
    if plan.nf4_frozen_weights:
        uses.append("for building the model, whose frozen weights are quantized to NF4 after")
    # else: a model that declares 4-bit weights (its BitsAndBytesConfig) is built there too
    return " and ".join(uses) or "for building the model, whose frozen weights are quantized to 4 bits after"


def breakdown_table(bd, plan, limit_bytes: int | None = None, title: str = "breakdown",
                    optimizer: str | None = None) -> Table:
    """`optimizer`: the optimizer's class name, where not the default AdamW (the model file's optimizer())."""
    from ..memory.breakdown import PART_HELP, PART_LABELS, optimizer_help

    table = Table(title=f"{title}: peak in {bd.phase} - {plan.describe()}", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for col, just in (("part", "left"), ("bytes", "right"), ("share", "right"), ("what", "left")):
        table.add_column(col, justify=just, no_wrap=col != "what")
    peak = bd.tensor_peak_bytes or 1
    for name, n in bd.part_bytes().items():
        what = optimizer_help(plan, optimizer) if name == "optimizer_state" else PART_HELP[name]
        table.add_row(PART_LABELS[name], fmt_bytes(n), f"{n / peak:.0%}", f"[dim]{what}[/]")
    table.add_section()
    table.add_row("[bold]tensor peak[/]", f"[bold]{fmt_bytes(bd.tensor_peak_bytes)}[/]", "", "[dim]the parts' sum[/]")
    card = bd.margin.startswith("card:")
    if card:  # the card's margin, line by line
        allocator = bd.margin_bytes - bd.context_bytes - bd.workspace_bytes
        for label, n, what in (("+ CUDA context", bd.context_bytes, "outside PyTorch's allocator (the card's)"),
                               ("+ cuBLAS workspaces", bd.workspace_bytes, "one per handle: forward's, backward's"),
                               ("+ caching allocator", allocator, "rounding and cached blocks, as modelled")):
            table.add_row(label, fmt_bytes(n), "", f"[dim]{what}[/]")
    else:
        table.add_row(f"+ margin {bd.margin}", fmt_bytes(bd.margin_bytes), "",
                      "[dim]CUDA context, workspaces, allocator rounding (--margin)[/]")
    style = "" if limit_bytes is None else ("green" if bd.peak_bytes <= limit_bytes else "red")
    table.add_row("[bold]peak[/]", f"[bold {style}]{fmt_bytes(bd.peak_bytes)}[/]" if style else
                  f"[bold]{fmt_bytes(bd.peak_bytes)}[/]", "", "")
    if bd.modelled_reserved_bytes and not card:
        over = bd.modelled_reserved_bytes / peak - 1
        past = limit_bytes is not None and bd.modelled_reserved_bytes > limit_bytes  # (a flat margin that is too small)
        table.add_row("allocator model", f"[red]{fmt_bytes(bd.modelled_reserved_bytes)}[/]" if past else
                      fmt_bytes(bd.modelled_reserved_bytes), f"{over:+.0%}",
                      "[red]past what is allowed: on a card this plan may run out of memory; the card's own margin "
                      "(no --margin) counts it[/]" if past else
                      "[dim]what CUDA's caching allocator would reserve for these tensors (not in the peak)[/]")
    if bd.host_bytes:
        table.add_row("host memory", fmt_bytes(bd.host_bytes), "", f"[dim]{host_use(plan)}: not in the GPU's peak[/]")
    if limit_bytes is not None:
        table.add_row("allowed", fmt_bytes(limit_bytes), "", "[dim]budget less headroom[/]")
    return table


def savings_table(savings, bd) -> Table:
    """estimate --breakdown: each lever's saving, the plan estimated again with that lever off."""
    table = Table(title=f"what each lever saves: the plan again without it (peak {fmt_bytes(bd.peak_bytes)})",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col, just in (("lever", "left"), ("peak without it", "right"), ("saves", "right")):
        table.add_column(col, justify=just, no_wrap=True)
    for s in savings:
        table.add_row(s.label, fmt_bytes(s.peak_bytes) if s.peak_bytes is not None else f"[dim]{escape(s.why)}[/]",
                      "-" if s.saved_bytes is None else fmt_bytes(s.saved_bytes) if s.saved_bytes >= 0 else
                      f"[red]costs {fmt_bytes(-s.saved_bytes)}[/]")
    if not savings:
        table.add_row("[dim]none: the plan uses no lever[/]", "", "")
    return table


def print_levers(levers, plan) -> None:
    if levers:
        out.print(f"[bold]what would help[/] {plan.describe(with_global=False)} fit (estimates):")
        for lever in levers:
            out.print(f"  - {lever}")


def _delta(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{'+' if n > 0 else ''}{fmt_bytes(n)}" if n else "0"


def render_check(result, config_path: Path) -> None:
    from ..memory.breakdown import PART_LABELS

    where = {"fake": "fake device (estimated)", "cpu": "cpu device", "cuda": "the GPU"}[result.device]
    out.print(f"checked [bold]{config_path}[/] on the {where}: {result.plan.describe()}")
    old, new = result.old_peak_bytes, result.new_peak_bytes
    grew = None if old is None or new is None else new - old
    out.print(f"  old peak  {fmt_bytes(old)}   " + ("(recorded in the config)" if old is not None else
                                                  "(none recorded in the config for this plan)"))
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
        o, n = result.old.host_bytes if result.old else None, result.new.host_bytes
        if n or o:  # the offloaded parts (and an NF4 build), apart from the device's peak
            table.add_row("host memory", fmt_bytes(o), fmt_bytes(n), _delta(n - o) if o is not None else "-")
        out.print(table)
        if result.old is None:
            out.print("[dim]  (no old column: the config records the peak alone, as `probe` writes it; `oomtune "
                      "estimate` writes one with its breakdown)[/]")
    for note in result.notes:
        out.print(f"[yellow]note:[/] {escape(note)}")
    if result.fits:
        out.print("[bold green]still fits[/]")
    else:
        reason = result.oom_message or (f"peak {fmt_bytes(new)} > {fmt_bytes(result.limit_bytes)} allowed")
        err.print(f"[bold red]no longer fits:[/] {reason}")


def check_json(result) -> dict:
    return {
        "fits": result.fits, "device": result.device, "plan": to_dict(result.plan),
        "budget_bytes": result.budget_bytes, "headroom": result.headroom, "limit_bytes": result.limit_bytes,
        "old_peak_bytes": result.old_peak_bytes, "new_peak_bytes": result.new_peak_bytes,
        "old_breakdown": to_dict(result.old) if result.old else None,
        "new_breakdown": to_dict(result.new) if result.new else None,
        "difference": result.difference, "oom_message": result.oom_message,
        "budget_clamped_from_bytes": result.budget_clamped_from, "notes": list(result.notes),
    }


def render_what_if(result, as_json: bool) -> None:
    """estimate --micro-batch: one plan's breakdown and, given a budget, whether it fits (exit 1 if not)."""
    plan, note = result.plan, result.note
    if as_json:
        print_json(json.dumps({"estimated": True, "card": result.card, "plan": to_dict(plan), "fits": result.fits,
                          "budget_bytes": result.budget_bytes, "limit_bytes": result.limit_bytes,
                          "breakdown": to_dict(result.breakdown), "levers": list(result.levers),
                          **({"savings": to_dict(result.savings)} if result.savings is not None else {}),
                          **({"note": note} if note else {}), "notes": list(result.notes)}, indent=2))
    else:
        for line in ((note,) if note else ()) + result.notes:
            err.print(f"[yellow]note:[/] {escape(line)}")
        title = f"estimate for {result.card}" if result.card else "estimate"
        out.print(breakdown_table(result.breakdown, plan, result.limit_bytes, title, result.optimizer))
        if result.savings is not None:
            out.print(savings_table(result.savings, result.breakdown))
        if result.fits is not None:
            verdict = "[bold green]fits[/]" if result.fits else "[bold red]does not fit[/]"
            out.print(f"{verdict}: peak {fmt_bytes(result.breakdown.peak_bytes)} vs {fmt_bytes(result.limit_bytes)} "
                      f"allowed (budget {fmt_bytes(result.budget_bytes)}, {result.headroom:.0%} headroom)")
            print_levers(result.levers, plan)
    if result.fits is False:
        raise typer.Exit(1)
