"""`make bench-levers`: `oomtune estimate` on a 7B Llama (built from its config on fake tensors, no weights) at
batch 8, context 2048, for the fine-tuning cases the levers past accumulation are for: full fine-tuning and LoRA
on a 24 GB card, LoRA on a 12 GB card (from the model file, and from a Hugging Face folder with LoRA flags), and
QLoRA with the model file's BitsAndBytesConfig (bitsandbytes' 4-bit layout on every rung); and litgpt's own 7B LoRA
code on an A100 40GB at its published runs' batch 1 x 1304 tokens (needs `pip install --no-deps litgpt`). The
plan (or why nothing fits), its peak and host memory, the trials and the wall time of each go into bench/RESULTS.md
between `<!-- levers:begin -->` and `<!-- levers:end -->`.

    .venv/bin/python -m bench.bench_levers [--out bench/RESULTS.md]

Every number written comes from this run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from bench.sections import write_section
from oomtune.units import format_bytes, utc_now

ROOT = Path(__file__).resolve().parent.parent
CASES = [  # (what, the command's arguments after `oomtune estimate`)
    ("full fine-tuning, 24 GB card", ["examples/finetune/llama_7b.py", "--gpu", "rtx4090"]),
    ("LoRA, 24 GB card", ["examples/finetune/llama_7b_lora.py", "--gpu", "rtx4090"]),
    ("LoRA, 12 GB card", ["examples/finetune/llama_7b_lora.py", "--gpu", "rtx3060"]),
    ("LoRA, 12 GB card, asked as a Hugging Face folder (no Python)",  # the same model: plan and bytes must match
     ["examples/hf/llama-2-7b", "--gpu", "rtx3060", "--batch", "8", "--context", "2048", "--lora-r", "16",
      "--lora-alpha", "32", "--lora-targets", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"]),
    # the same LoRA, its base loaded 4-bit by bitsandbytes as its BitsAndBytesConfig says (NF4, double-quantized)
    ("QLoRA as Hugging Face's guides run it (bitsandbytes NF4), 12 GB card",
     ["examples/finetune/llama_7b_qlora_bnb.py", "--gpu", "rtx3060"]),
    # a model file of code nobody here wrote: litgpt's own Llama 2 7B with its LoRA on the query and value parts
    ("LoRA with litgpt's own model code, A100 40GB (its published runs' card)",
     ["bench/models/litgpt_finetune.py", "--gpu", "a100-40"]),
]


def run_case(args: list[str], out: str | None) -> tuple[dict, float, list[str]]:
    """`oomtune estimate ARGS [--out OUT] --json` from this checkout: (its report, wall seconds, the command). Exit 1
    (nothing fits, or a what-if that does not fit its card) is a finished answer too."""
    command = ["oomtune", "estimate", *args, *(["--out", out] if out else []), "--json"]
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "oomtune", *command[1:]], cwd=ROOT, capture_output=True,
                          text=True)  # (this checkout's oomtune, whatever the venv's entry point names)
    wall = time.perf_counter() - start
    if proc.returncode not in (0, 1):  # 1 = nothing fits, still a finished ladder
        raise SystemExit(f"{shlex.join(command)} failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout), wall, command


def row(what: str, report: dict, wall: float, command: list[str]) -> list[str]:
    from oomtune.config.schema import Plan

    rungs = " -> ".join(r["rung"] for r in report["rungs"]) or "none (the floor is over the budget)"
    if report["fits"]:
        result = Plan(**report["plan"]).describe()
        peak = f"{format_bytes(report['peak_bytes'])} ({report['peak_bytes']:,} B)"
        host = f"{format_bytes(report['host_peak_bytes'])} ({report['host_peak_bytes']:,} B)" \
            if report["host_peak_bytes"] else "-"
    else:
        result, peak, host = f"nothing fits: {report['why_nothing_fits']}", "-", "-"
    return [what, f"`{shlex.join(command)}`", rungs, result, peak, host, str(len(report["trials"])), f"{wall:.0f}"]


def section(rows: list[list[str]], unit: tuple[float, float]) -> str:
    import torch

    header = ["case", "command", "rungs climbed", "plan", "peak (margin incl.)", "host memory", "trials",
              "wall s", "in bare steps"]
    rows = [[*r, f"{float(r[-1]) / (sum(unit) / 2):.0f}"] for r in rows]
    lines = [
        f"Written by `make bench-levers` (`python -m bench.bench_levers`) on {utc_now()}, torch {torch.__version__}, "
        "on this machine's CPU: each estimate builds Llama-2-7B's shape (6.7B parameters) on fake tensors, batch 8, "
        "context 2048 (no shorter context allowed; litgpt's row: its own code, batch 1 at 1304 tokens, as its "
        "published runs), and climbs the ladder; the wall time is the whole command's. "
        f"The machine's speed, a bare fake step of GPT-2 small (best of 3, warm; `make bench-estimate`'s unit), "
        f"before and after the questions: {unit[0]:.2f} s and {unit[1]:.2f} s; each wall time is also given in "
        "those steps (their mean), which compares runs on days of different speed.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join(" --- " for _ in header) + "|",
        *("| " + " | ".join(cell.replace("|", "/") for cell in r) + " |" for r in rows),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "RESULTS.md")
    args = ap.parse_args(argv)
    rows = []
    from bench.bench_estimate_speed import best_bare_step  # (it imports CASES from here)

    before = best_bare_step()
    for i, (what, case) in enumerate(CASES):
        print(f"[{i + 1}/{len(CASES)}] oomtune estimate {' '.join(case)}", file=sys.stderr, flush=True)
        report, wall, command = run_case(case, f"out/bench/llama_7b_{i}.yaml")
        rows.append(row(what, report, wall, command))
        print(f"    {wall:.0f} s: {rows[-1][3][:120]}", file=sys.stderr, flush=True)
    text = section(rows, (before, best_bare_step()))
    write_section(args.out, "levers", text, heading="## Past accumulation: 7B Llama estimates")
    print(f"wrote the levers section of {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
