"""Every option the commands share, defined once with its help. Options default to None where "not given" differs
from any value (the library decides the default); on/off flags are `--x/--no-x`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..memory.cards import GENERIC, GPUS

ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="The config `oomtune probe` (or estimate) wrote.")]

# -- the ladder's targets and the search (probe, estimate) ---------------------------------------------
BatchOpt = Annotated[int | None, typer.Option("--batch", "-b", help="Target global batch B (kept exact). Default: the "
                                              "model file's DEFAULTS, else 32.")]
ContextOpt = Annotated[int | None, typer.Option("--context", "-t", help="Target context length T. Default: DEFAULTS, "
                                                "else 512.")]
MinContextOpt = Annotated[int | None, typer.Option("--min-context", help="Shortest context you accept (default: T, "
                                                   "i.e. never cut).")]
HeadroomOpt = Annotated[float, typer.Option("--headroom", help="Fraction of the budget kept free.")]
StepsOpt = Annotated[int, typer.Option("--steps", help="Optimizer steps per trial, at least 2 (default 2: the "
                                        "optimizer state exists when the peak is read).")]
AmpOpt = Annotated[str, typer.Option("--amp", help="Mixed precision for the amp rungs: auto (bf16 where the device "
                                     "has it, else fp16) | bf16 | fp16.")]
LeversOpt = Annotated[str | None, typer.Option(
    "--levers", help="The levers the ladder may use, comma-separated (default: all): amp, checkpointing, "
    "accumulation, fsdp, then past accumulation chunked-loss, step-in-backward (the whole batch at once), "
    "bf16-true, 8bit, nf4, offload, offload-activations (climbed only where the others fit no plan at the target "
    "context). amp,checkpointing,accumulation is the classic ladder; none: the fp32 rung alone, the whole batch at "
    "once. With estimate --micro-batch: the levers past accumulation that one plan uses (chunked-loss, "
    "step-in-backward, bf16-true, 8bit, nf4, offload, offload-activations).")]
CompileOpt = Annotated[bool, typer.Option(
    "--compile", help="Compile each block (transformer layer) and the loss, as torchtune does: on cuda with "
    "torch.compile, on cpu/fake as AOTAutograd partitions it and inductor keeps its memory. Same as adding compile "
    "to --levers; every rung is compiled.")]
OutOpt = Annotated[Path, typer.Option("--out", "-o", help="Where to write the config.")]
SnapshotOpt = Annotated[Path | None, typer.Option(
    "--memory-snapshot", help="Also write one trial of the plan (estimate: of the smallest plan when nothing fits) as "
    "PyTorch's memory snapshot pickle: `python -m torch.cuda._memory_viz trace_plot FILE -o FILE.html`, or "
    "pytorch.org/memory_viz.")]
JsonOpt = Annotated[bool, typer.Option("--json/--no-json", help="Print the result as JSON (for CI).")]
DebugOpt = Annotated[bool, typer.Option("--debug/--no-debug", help="Show full tracebacks instead of one-line errors.")]
GpuOpt = Annotated[str | None, typer.Option(
    "--gpu", help="Account like this CUDA card (simulated devices: fake, cpu): its memory, CUDA autocast's policy, the "
    "attention kernel it would pick, its CUDA context, cuBLAS workspaces and caching allocator. One of "
    f"{', '.join(spec.aliases[0] for spec in (*GPUS, GENERIC))}.")]
MarginOpt = Annotated[str | None, typer.Option(
    "--margin", help="A flat rule instead of the card's own margin (its CUDA context, cuBLAS workspaces and caching "
    "allocator, modelled): a fixed part + a percentage of the tensor peak, e.g. 512MiB+5%; 0 turns it off.")]

# -- launching ranks with torchrun (probe, train): these never reach the workers ------------------------
NprocOpt = Annotated[int | None, typer.Option("--nproc-per-node", help="Ranks (processes, one per GPU) on this "
                                              "node: runs the command under torchrun.", rich_help_panel="ranks")]
NnodesOpt = Annotated[int, typer.Option("--nnodes", help="Nodes (machines) taking part (torchrun's).",
                                        rich_help_panel="ranks")]
NodeRankOpt = Annotated[int, typer.Option("--node-rank", help="This node's index, 0 on the one with --master-addr "
                                          "(torchrun's).", rich_help_panel="ranks")]
MasterAddrOpt = Annotated[str, typer.Option("--master-addr", help="Address of node 0 (torchrun's).",
                                            rich_help_panel="ranks")]
MasterPortOpt = Annotated[int | None, typer.Option("--master-port", help="Port of the rendezvous on node 0 (default: "
                                                   "a free one on one node, 29500 on several).",
                                                   rich_help_panel="ranks")]
DistTimeoutOpt = Annotated[float, typer.Option("--dist-timeout", help="Seconds a collective waits for the other ranks "
                                               "before the run stops with an error (a rank that died or hangs); "
                                               "joining waits at least 120 s.",
                                               rich_help_panel="ranks")]



def budget_option(default: str, what: str = "Memory to fit in: 24GiB, 512MiB, 80%") -> typer.models.OptionInfo:
    """--budget: the same option everywhere; only what it defaults to differs by command."""
    return typer.Option("--budget", help=f"{what}; a bare number is bytes (default: {default}).")


def device_option(choices: str) -> typer.models.OptionInfo:
    return typer.Option("--device", "-d", help=choices)
