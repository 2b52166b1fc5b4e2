"""`oomtune gpus`: what NVML sees — every GPU's memory, the processes holding it, driver/CUDA versions, bf16."""

from __future__ import annotations

import dataclasses
import json
import os

from rich import box
from rich.table import Table

from . import app
from .console import fmt_bytes, out
from .guard import print_json, user_errors
from .options import DebugOpt, JsonOpt


def _cc(gpu) -> str:
    return "?" if gpu.compute_capability is None else "{}.{}".format(*gpu.compute_capability)


def _yes_no(v: bool | None) -> str:
    return "?" if v is None else ("yes" if v else "no")


def report_json(report) -> dict:
    gpus = []
    for g in report.gpus:
        d = dataclasses.asdict(g)
        d["compute_capability"] = None if g.compute_capability is None else _cc(g)
        d["pci"] = None if g.pci is None else list(g.pci)
        d["bf16"] = g.bf16
        gpus.append(d)
    return {"available": report.available, "reason": report.reason, "driver_version": report.driver_version,
            "cuda_driver_version": report.cuda_driver_version, "gpus": gpus}


def gpus_table(report) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)  # fits 80 columns
    for col, just in (("gpu", "right"), ("name", "left"), ("total", "right"), ("used", "right"),
                      ("free", "right"), ("cc", "right"), ("bf16", "left"), ("procs", "right")):
        table.add_column(col, justify=just, no_wrap=col != "name")
    for g in report.gpus:
        table.add_row(str(g.index), g.name, fmt_bytes(g.total_bytes), fmt_bytes(g.used_bytes),
                      f"[green]{fmt_bytes(g.free_bytes)}[/]", _cc(g), _yes_no(g.bf16), str(len(g.processes)))
    return table


def processes_table(gpu) -> Table:
    table = Table(title=f"processes on GPU {gpu.index}", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("pid", justify="right", no_wrap=True)
    table.add_column("memory", justify="right", no_wrap=True)
    table.add_column("type", no_wrap=True)
    table.add_column("name", overflow="fold")
    for p in gpu.processes:
        table.add_row(str(p.pid), fmt_bytes(p.used_bytes) if p.used_bytes is not None else "n/a", p.kind, p.name)
    return table


@app.command()
def gpus(
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
):
    """List every GPU NVML sees: memory total/used/free, the processes using it, driver and CUDA versions,
    bf16 support. Exit 0 (with a message) where there is no NVIDIA driver."""
    with user_errors(debug, as_json):
        from ..memory import nvml

        report = nvml.query()
        if as_json:
            print_json(json.dumps(report_json(report), indent=2))
            return
        if not report.available:
            out.print(f"[yellow]no NVIDIA GPU visible:[/] NVML is unavailable ({report.reason}); is the NVIDIA "
                      "driver installed? Without a GPU, [cyan]--device cpu[/] simulates a GPU's memory limit and "
                      "[cyan]oomtune estimate[/] predicts one.", soft_wrap=True)  # one line, for scripts and logs
            return
        n = len(report.gpus)
        out.print(f"NVIDIA driver {report.driver_version or '?'}, CUDA {report.cuda_driver_version or '?'} "
                  f"(the newest the driver runs); {n} GPU{'s' if n != 1 else ''}")
        if not report.gpus:
            return
        out.print(gpus_table(report))
        for g in report.gpus:
            if g.processes:
                out.print(processes_table(g))
            else:
                out.print(f"[dim]no processes on GPU {g.index}[/]")
        if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
            out.print(f"[dim]GPU numbers are NVML's (as nvidia-smi's); PyTorch's cuda:N follows "
                      f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']}[/]")
