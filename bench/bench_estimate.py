"""`make bench-estimate`: `oomtune estimate` on GPT-2 small (124M parameters, context 1024) runs the whole ladder
on fake tensors on this machine; its wall time and trial count, and the breakdown of the design's four reference
plans (batch 8, context 1024, AdamW) against the design's figures, go into bench/RESULTS.md between
`<!-- estimate:begin -->` and `<!-- estimate:end -->` (only that block is replaced; the file is created if
missing).

    .venv/bin/python -m bench.bench_estimate [--out bench/RESULTS.md]

Every number written comes from this run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from bench.sections import write_section
from oomtune.units import utc_now

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench/models/gpt2_small.py"
# T4: 15 GiB and no bf16 (the amp rungs are fp16 + GradScaler); a global batch of 32 at full context does not
# fit on fp32 or fp16, so the search climbs every rung and ends with accumulation
COMMAND = ["oomtune", "estimate", MODEL, "--gpu", "t4", "--batch", "32", "--context", "1024",
           "--out", "out/bench/gpt2_small_t4.yaml", "--json"]
GiB = 1024**3

# ../shared/design.md, "Notes on the memory tracker": one step of a 124M GPT-2, batch 8, context 1024, AdamW,
# CPU fake tensors, GiB
REFERENCE = {("fp32", False): 10.98, ("fp32", True): 6.75, ("bf16", False): 9.23, ("bf16", True): 6.81}


def gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def run_ladder() -> tuple[dict, float]:
    exe = Path(sys.executable).parent / "oomtune"
    start = time.perf_counter()
    proc = subprocess.run([str(exe), *COMMAND[1:]], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode not in (0, 1):  # 1 = nothing fits, still a finished ladder
        raise SystemExit(f"{shlex.join(COMMAND)} failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout), wall


def reference_breakdowns() -> list[dict]:
    """The four reference plans, margin 0 (the design's figures are tensor peaks), tied and untied head."""
    sys.path.insert(0, str(ROOT))
    from oomtune.config.schema import Plan
    from oomtune.memory.breakdown import breakdown
    from oomtune.memory.devices import FakeDevice
    from oomtune.memory.margin import Margin
    from oomtune.model_file import load_model_file

    mf = load_model_file(ROOT / MODEL)
    rows = []
    for tied in (True, False):
        mf.module.TIE_WEIGHTS = tied
        for (precision, ckpt), ref in REFERENCE.items():
            start = time.perf_counter()
            bd = breakdown(mf, Plan(8, 1024, precision, ckpt), FakeDevice("1TiB", margin=Margin()))
            rows.append({"tied": tied, "precision": precision, "checkpointing": ckpt, "reference_gib": ref,
                         "breakdown": bd, "seconds": time.perf_counter() - start})
    mf.module.TIE_WEIGHTS = True
    return rows


def section(report: dict, wall: float, rows: list[dict]) -> str:
    import torch

    lines = [
        "### `oomtune estimate`: GPT-2 small (124M parameters, context 1024) on fake tensors",
        "",
        f"Command (from the repository root): `{shlex.join(COMMAND)}`  ",
        f"Machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, no GPU; "
        f"{utc_now()}.",
        "",
        "| wall time | trials | trials per rung | plan | peak = tensors + margin | allowed |",
        "| ---: | ---: | --- | --- | ---: | ---: |",
    ]
    per_rung = ", ".join(f"{r['precision']}{'+ckpt' if r['activation_checkpointing'] else ''}: {r['trials']}"
                         for r in report["rungs"])
    extra = len(report["trials"]) - sum(r["trials"] for r in report["rungs"])
    if extra:
        per_rung += f", accumulation check: {extra}"
    plan = report["plan"]
    if plan:
        plan_text = (f"micro-batch {plan['micro_batch_size']} x {plan['grad_accum_steps']} accumulation, context "
                     f"{plan['context_length']}, {plan['precision']}"
                     + (", checkpointing" if plan["activation_checkpointing"] else ""))
    else:
        plan_text = "nothing fits"
    bd = report["breakdown"]
    lines.append(f"| {wall:.1f} s | {len(report['trials'])} | {per_rung} | {plan_text} | "
                 f"{gib(bd['peak_bytes'])} GiB = {gib(bd['tensor_peak_bytes'])} + {gib(bd['margin_bytes'])} "
                 f"(margin {report['margin']}) | {gib(report['limit_bytes'])} GiB |")
    lines += [
        "",
        f"Wall time includes starting Python and importing torch, the ladder's {len(report['trials'])} trials "
        "(two optimizer steps each) and the breakdown run of the chosen plan.",
        "",
        "Breakdown of the design's reference plans (batch 8, context 1024, AdamW, one trial = two steps, tensor "
        "peak without margin, GiB). GPT-2 ties its output head to the token embedding; untying it adds a "
        "38.6M-parameter matrix:",
        "",
        "| plan | design | ours, tied | ours, untied | untied - design | phase | params | grads | AdamW | "
        "autocast copies | saved act. | temporaries |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    by = {(r["tied"], r["precision"], r["checkpointing"]): r for r in rows}
    for (precision, ckpt), ref in REFERENCE.items():
        t, u = by[(True, precision, ckpt)]["breakdown"], by[(False, precision, ckpt)]["breakdown"]
        lines.append(
            f"| {precision}{' + ckpt' if ckpt else ''} | {ref:.2f} | {t.tensor_peak_bytes / GiB:.3f} | "
            f"{u.tensor_peak_bytes / GiB:.3f} | {u.tensor_peak_bytes / GiB - ref:+.3f} | {t.phase} | "
            f"{gib(t.parameters_bytes)} | {gib(t.gradients_bytes)} | {gib(t.optimizer_state_bytes)} | "
            f"{gib(t.autocast_copies_bytes)} | {gib(t.activations_bytes)} | {gib(t.temporaries_bytes)} |")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines += ["", "(the part columns are the tied model's; each row's parts sum to its tensor peak exactly)", "",
              f"The 2 cores were shared with other jobs (load average {load} at the end): the wall time is one "
              "run on a busy machine, the byte counts do not depend on it."]
    return "\n".join(lines)



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "RESULTS.md")
    args = ap.parse_args(argv)
    print(f"running: {shlex.join(COMMAND)}", file=sys.stderr)
    report, wall = run_ladder()
    print(f"  {len(report['trials'])} trials in {wall:.1f} s; plan {report['plan']}", file=sys.stderr)
    rows = reference_breakdowns()
    for r in rows:
        print(f"  {'tied' if r['tied'] else 'untied'} {r['precision']}{'+ckpt' if r['checkpointing'] else ''}: "
              f"{gib(r['breakdown'].tensor_peak_bytes)} GiB (design {r['reference_gib']}) in {r['seconds']:.1f} s",
              file=sys.stderr)
    write_section(args.out, "estimate", section(report, wall, rows), heading="## Estimate")
    print(f"wrote the estimate section of {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
