"""`oomtune train`: a progress bar and one line per logged step over `oomtune.train`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ..dist.launch import DEFAULT_TIMEOUT_S, worker_rank
from . import app
from .console import err, fmt_bytes, out, rate_unit
from .guard import user_errors
from .options import (
    ConfigOpt,
    DebugOpt,
    DistTimeoutOpt,
    MasterAddrOpt,
    MasterPortOpt,
    NnodesOpt,
    NodeRankOpt,
    NprocOpt,
    budget_option,
    device_option,
)
from .ranks import flags, parse_rank_budgets

RankBudgetOpt = Annotated[list[str] | None, typer.Option("--rank-budget", help="RANK=BUDGET: another simulated "
                                                         "budget on one rank (cpu device; repeatable), to rehearse "
                                                         "one rank running out of memory.", rich_help_panel="ranks")]


def _num(x) -> str:
    return "n/a" if x is None else f"{x:.4f}"  # None: not finite (metrics.jsonl writes null)


def _metrics_line(m: dict, unit: str = "tok/s") -> str:
    parts = [f"step {m['step']:>6}", f"loss {_num(m['loss'])}"]
    if "eval_loss" in m:
        parts.append(f"[bold]eval {_num(m['eval_loss'])}[/]")
    parts.append(f"lr {m['lr']:.2e}")
    if m.get("tokens_per_s"):
        parts.append(f"{m['tokens_per_s']:,.0f} {unit}")
    parts.append(f"peak {fmt_bytes(m['peak_bytes'])}")
    if m.get("nvml_used_bytes") is not None:
        parts.append(f"nvml {fmt_bytes(m['nvml_used_bytes'])}")
    return "  ".join(parts)


def _render(progress: Progress, task):
    """An on_event callback that renders training events above the progress bar (stderr)."""
    from ..train.events import Checkpointed, Note, OomFallback, Started, StepDone

    say = progress.console.print
    unit = [rate_unit(2)]  # tok/s; ex/s for a plan of context 1 (told by Started)

    def on_event(e) -> None:
        if isinstance(e, Started):
            unit[0] = rate_unit(e.plan.context_length)
            where = f"resuming from {e.resumed_from} at step {e.start_step}" if e.resumed_from else "from scratch"
            say(f"training {where} on {e.device}: {e.plan.describe()}, {e.train.steps} steps, lr {e.train.lr:g}, "
                f"run dir {e.run_dir}")
            progress.update(task, total=e.train.steps, completed=e.start_step)
        elif isinstance(e, Note):
            say(f"[yellow]warning:[/] {e.message}" if e.warning else f"[dim]{e.message}[/]")
        elif isinstance(e, StepDone):
            fields = {}
            if e.metrics is not None:
                m = e.metrics
                mem = m.get("nvml_used_bytes") if m.get("nvml_used_bytes") is not None else m["peak_bytes"]
                fields = {"loss": f"loss {_num(m['loss'])}", "speed": f"{m['tokens_per_s'] or 0:,.0f} {unit[0]}",
                          "memory": f"{'nvml' if 'nvml_used_bytes' in m else 'peak'} {fmt_bytes(mem)}"}
                say(_metrics_line(m, unit[0]))
            progress.update(task, completed=e.step, **fields)
        elif isinstance(e, OomFallback):
            say(f"[bold yellow]out of memory[/] at step {e.step} ({e.phase}): {e.message}")
            say(f"  falling back: micro-batch {e.old_plan.micro_batch_size} x{e.old_plan.grad_accum_steps} -> "
                f"{e.new_plan.micro_batch_size} x{e.new_plan.grad_accum_steps} (global batch "
                f"{e.new_plan.global_batch_size} unchanged); retrying the same batch")
        elif isinstance(e, Checkpointed):
            say(f"[dim]checkpoint {e.path} (step {e.step}, {e.reason})[/]")
            if e.pretrained is not None:
                say(f"[dim]{e.pretrained.name} saved as Hugging Face does: {e.pretrained}[/]")

    return on_event


def _report(result, config: Path, run_dir_given: bool) -> None:
    if result.fallbacks:
        where = f"written to {config}" if result.config_updated else f"not written: {config} is unchanged"
        out.print(f"[yellow]plan changed after out-of-memory:[/] {result.plan.describe()} ({where})")
    if result.interrupted:
        out.print(f"stopped at step {result.step}/{result.steps}; checkpoint {result.checkpoint}. "
                  f"Continue with [cyan]oomtune train --config {config} --resume[/]"
                  + (f" --run-dir {result.run_dir}" if run_dir_given else ""))
        raise typer.Exit(130)
    if result.nothing_to_do:
        out.print(f"nothing to do: the run in {result.run_dir} is at step {result.step}, already at or past "
                  f"--steps {result.steps} (raise --steps to train longer); checkpoint {result.checkpoint}")
        return
    first, last = result.first_loss, result.last_loss
    losses = ("no steps run" if first is None or last is None
              else f"loss {last:.4f}" if f"{first:.4f}" == f"{last:.4f}"  # one logged step (a short resume)
              else f"loss {first:.4f} -> {last:.4f}")
    ev = f", eval loss {result.eval_loss:.4f}" if result.eval_loss is not None else ""
    resumed = (f" ({result.step - result.start_step} this run, from step {result.start_step})"
               if result.start_step else "")
    out.print(f"[bold green]trained[/] {result.step}/{result.steps} steps{resumed} in {result.seconds:.1f}s: "
              f"{losses}{ev}")
    out.print(f"metrics {result.run_dir / 'metrics.jsonl'}; checkpoint {result.checkpoint}")


def _on_relaunch(latest: Path | None) -> None:
    err.print(f"[yellow]relaunching every rank[/] with the halved plan, "
              f"{f'from {latest}' if latest else 'from the start (no checkpoint yet)'}")


def _train_here(config: Path, overrides: dict, resume: bool, device, budget, rank_budgets, dist_timeout,
                run_dir_given: bool) -> None:
    """This process trains: rank 0 (or the only process) reports with a progress bar; the other ranks only say
    what goes wrong."""
    from ..train.trainer import Trainer

    kwargs = {"overrides": overrides, "device": device, "budget": budget, "resume": resume,
              "rank_budgets": rank_budgets, "dist_timeout": dist_timeout}
    if worker_rank() not in (None, 0):
        if Trainer(config, **kwargs).run().interrupted:
            raise typer.Exit(130)
        return
    progress = Progress(TextColumn("[bold]train[/]"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[loss]}"), TextColumn("{task.fields[speed]}"),
                        TextColumn("{task.fields[memory]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                        console=err, transient=True)
    task = progress.add_task("train", total=None, loss="", speed="", memory="")
    trainer = Trainer(config, on_event=_render(progress, task), **kwargs)
    with progress:
        result = trainer.run()
    _report(result, config, run_dir_given)


@app.command()
def train(
    config: ConfigOpt,
    steps: Annotated[int | None, typer.Option(help="Optimizer steps (train.steps).")] = None,
    lr: Annotated[float | None, typer.Option(help="Peak learning rate (train.lr).")] = None,
    min_lr: Annotated[float | None, typer.Option(help="Where cosine decay ends (train.min_lr).")] = None,
    warmup_steps: Annotated[int | None, typer.Option(help="Linear warmup steps (train.warmup_steps).")] = None,
    weight_decay: Annotated[float | None, typer.Option(help="AdamW weight decay (train.weight_decay).")] = None,
    clip_grad_norm: Annotated[float | None, typer.Option(help="Max gradient norm (train.clip_grad_norm).")] = None,
    eval_interval: Annotated[int | None, typer.Option(help="Steps between evaluations (train.eval_interval).")]
    = None,
    eval_steps: Annotated[int | None, typer.Option(help="Batches per evaluation, at most (train.eval_steps).")] = None,
    checkpoint_interval: Annotated[int | None, typer.Option(help="Steps between checkpoints "
                                                            "(train.checkpoint_interval).")] = None,
    log_every_n_steps: Annotated[int | None, typer.Option(help="Steps between metric lines "
                                                          "(train.log_every_n_steps).")] = None,
    run_dir: Annotated[str | None, typer.Option(help="Checkpoints, metrics.jsonl, events.jsonl (train.run_dir).")]
    = None,
    seed: Annotated[int | None, typer.Option(help="Seed of the model's and the data's RNGs (train.seed).")] = None,
    data: Annotated[str | None, typer.Option("--data", help="A JSONL ({\"text\": ...} a line) or text file, "
                    "tokenized by the Hugging Face model folder's tokenizer and packed to the plan's context "
                    "(train.data).")] = None,
    save_adapter: Annotated[bool | None, typer.Option("--save-adapter/--no-save-adapter", help="Save a PEFT adapter "
                            "(or a Hugging Face model) at every checkpoint, not only at the end.")] = None,
    resume: Annotated[bool, typer.Option("--resume/--no-resume", help="Continue from the latest checkpoint in "
                                         "the run dir (exactly: same data, same RNG).")] = False,
    device: Annotated[str | None, device_option("auto | cuda | cpu (default: where the config was probed).")] = None,
    budget: Annotated[str | None, budget_option("cuda: the free memory; cpu: the budget the config was probed "
                                                "with")] = None,
    nproc_per_node: NprocOpt = None,
    nnodes: NnodesOpt = 1,
    node_rank: NodeRankOpt = 0,
    master_addr: MasterAddrOpt = "127.0.0.1",
    master_port: MasterPortOpt = None,
    dist_timeout: DistTimeoutOpt = DEFAULT_TIMEOUT_S,
    rank_budget: RankBudgetOpt = None,
    debug: DebugOpt = False,
):
    """Train with the plan in CONFIG; an out-of-memory error mid-run halves the micro-batch (same global batch)
    and writes the plan that works back to CONFIG.

    Example: [cyan]oomtune train --config best.yaml --steps 200[/]

    On several GPUs: [cyan]oomtune train --config best.yaml --nproc-per-node 4[/] (DDP or FSDP2, as planned).
    """
    with user_errors(debug):
        overrides = {"steps": steps, "lr": lr, "min_lr": min_lr, "warmup_steps": warmup_steps,
                     "weight_decay": weight_decay, "clip_grad_norm": clip_grad_norm, "eval_interval": eval_interval,
                     "eval_steps": eval_steps, "checkpoint_interval": checkpoint_interval,
                     "log_every_n_steps": log_every_n_steps, "run_dir": run_dir,  # str: "" is refused, not "."
                     "seed": seed, "save_adapter": save_adapter, "data": data}
        rank_budgets = parse_rank_budgets(rank_budget)
        if nproc_per_node is None or worker_rank() is not None:
            _train_here(config, overrides, resume, device, budget, rank_budgets, dist_timeout, run_dir is not None)
            return
        from ..dist.launch import Launch
        from ..train.launcher import launch_training

        def worker_args(again: bool) -> list[str]:  # the launcher: check what can be checked, then torchrun
            return ["train", "--config", str(config), *(["--no-save-adapter"] if save_adapter is False else []),
                    *flags(**overrides, resume=again, device=device, budget=budget, dist_timeout=dist_timeout,
                           rank_budget=rank_budget, debug=debug)]

        launch_training(Launch(nproc_per_node, nnodes, node_rank, master_addr, master_port), config, overrides,
                        resume, worker_args, _on_relaunch)
