"""`make bench-estimate` (second part): how fast the estimate answers, measured side by side in one run.

- One bare FakeTensorMode training step of GPT-2 small (forward, backward, AdamW step; no tracker, no card rules),
  warm: the unit the ladder's cost is counted in.
- GPT-2 small's whole ladder with a card's rules (bench_estimate.COMMAND: --gpu t4, batch 32, context 1024), with
  every trial traced whole (`replays=False`: the estimate before issue 40) and as it runs by default (sizes replayed
  from two traces), in one process and with a rung's micro-batch 1 traced in a copy (search/fan_out.py).
- A 1B LoRA's search for the longest context on a T4 (LONG), with every context traced and by default (micro-batch
  1 at other contexts replayed from four: memory/context_curves.py).
- The 7B questions of `make bench-levers` asked of a model file, with every trial traced whole (`min_blocks=0`) and
  by default (repeated blocks made from traces of 2, 3 and 4 of them, sizes replayed), the latter also with no
  forked copies tracing side by side (search/fan_out.py; the 1B's question too).

Each pair must choose the same plan with the same peak, to the byte. Written into bench/RESULTS.md between
`<!-- estimate-speed:begin -->` and `<!-- estimate-speed:end -->`.

    .venv/bin/python -m bench.bench_estimate_speed [--out bench/RESULTS.md] [--skip-7b]
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

from bench.bench_estimate import MODEL
from bench.bench_levers import CASES
from bench.sections import write_section
from oomtune.units import utc_now

ROOT = Path(__file__).resolve().parent.parent
GPT2 = (MODEL, "t4", 32, 1024)
LONG = ("bench/models/llama_1b_lora.py", "t4", "7GiB", 16, 2048, 128, "amp,checkpointing,accumulation")


def bare_step_seconds() -> float:
    """A warm bare FakeTensorMode step of GPT-2 small at micro-batch 4, context 1024, fp32 (the second of two)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from oomtune.model_file import load_model_file

    mf = load_model_file(ROOT / MODEL)
    times = []
    with FakeTensorMode():
        model = mf.build()
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        for _ in range(2):
            batch = mf.batch(4, 1024, torch.device("cpu"))
            start = time.perf_counter()
            mf.loss(model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
    return times[-1]


def best_bare_step() -> float:
    """The machine's speed now: the best of three warm bare steps (it moves by 15% from one to the next, and by
    2.4x within a day: bench_levers gives its wall times in these too)."""
    return min(bare_step_seconds() for _ in range(3))


def timed_estimate(path: str, gpu: str, batch: int | None, context: int | None, **kw) -> tuple[float, object]:
    from oomtune.model_file import load_model_file
    from oomtune.search.estimate import estimate, make_fake_device
    from oomtune.search.options import resolve_targets
    from oomtune.search.trial import imports_settled

    mf = load_model_file(ROOT / path)
    targets = resolve_targets(mf, batch, context, None)
    gc.collect()  # as `oomtune estimate`'s process stands once its imports and the model file are loaded (little
    imports_settled()  # garbage: here, what earlier runs left is collected first), frozen as the CLI freezes it
    start = time.perf_counter()
    result = estimate(mf, make_fake_device(None, gpu, None), targets, **kw)
    return time.perf_counter() - start, result


def timed_context_search(traced: bool) -> tuple[float, object]:
    """LONG's question: micro-batch 1 does not fit 2048 tokens, the search bisects the context; `traced`: every
    context traced (no curves: prior.CHECKED out of reach), else the estimate as it runs."""
    import oomtune.search.prior as prior
    from oomtune.model_file import load_model_file
    from oomtune.search.estimate import estimate, make_fake_device
    from oomtune.search.options import parse_levers, resolve_targets
    from oomtune.search.trial import imports_settled

    path, gpu, budget, batch, context, min_context, levers = LONG
    mf = load_model_file(ROOT / path)
    checked, prior.CHECKED = prior.CHECKED, (1 << 30 if traced else prior.CHECKED)
    try:
        gc.collect()  # (as timed_estimate)
        imports_settled()
        start = time.perf_counter()
        result = estimate(mf, make_fake_device(budget, gpu, None), resolve_targets(mf, batch, context, min_context),
                          levers=parse_levers(levers))
        return time.perf_counter() - start, result
    finally:
        prior.CHECKED = checked


def _sources(result) -> str:
    counts = Counter(r.source for r in result.search.records)
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))


def alone(run):
    """`run()` with every measurement in this process (fan_out.PROCESSES = 1: no copies side by side)."""
    from oomtune.search import fan_out

    processes, fan_out.PROCESSES = fan_out.PROCESSES, 1
    try:
        return run()
    finally:
        fan_out.PROCESSES = processes


def row(what: str, before: tuple, after: tuple, unit: float | None, one: tuple | None = None) -> str:
    """A question's row; `one`: the defaults in one process (no copies), where copies run side by side."""
    (tb, rb), (ta, ra) = before, after
    same = rb.plan == ra.plan and rb.breakdown.peak_bytes == ra.breakdown.peak_bytes and \
        (one is None or (one[1].plan, one[1].breakdown) == (ra.plan, ra.breakdown))  # (copies: the whole breakdown)
    ratio = (" | " + ", ".join(f"{t / unit:.0f}x" for t in (tb, *(one[:1] if one else ()), ta))) if unit else " | "
    plan = ra.plan.describe(with_global=False) if ra.plan is not None else "nothing fits"
    alone_text = f"{one[0]:.1f} s" if one else "-"
    return (f"| {what} | {tb:.1f} s ({_sources(rb)}) | {alone_text} | {ta:.1f} s ({_sources(ra)}){ratio} | {plan} | "
            f"{rb.breakdown.peak_bytes:,} | {ra.breakdown.peak_bytes:,} | {'yes' if same else '**no**'} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "RESULTS.md")
    ap.add_argument("--skip-7b", action="store_true", help="GPT-2 small only (about 2 minutes instead of 30)")
    args = ap.parse_args(argv)
    import torch

    bare = best_bare_step()
    print(f"bare fake step: {bare:.2f} s", file=sys.stderr)
    before = timed_estimate(*GPT2, replays=False)
    best = lambda: min((timed_estimate(*GPT2) for _ in range(3)), key=lambda r: r[0])  # noqa: E731
    one = alone(best)
    rows = [row("GPT-2 small, T4, batch 32, context 1024", before, best(), bare, one)]
    print(rows[-1], file=sys.stderr)
    rows.append(row("1B Llama LoRA, T4 at 7 GiB, batch 16, the longest context of 128-2048 (amp, checkpointing, "
                    "accumulation)", timed_context_search(traced=True), timed_context_search(traced=False), None,
                    alone(lambda: timed_context_search(traced=False))))
    print(rows[-1], file=sys.stderr)
    for what, case in ([] if args.skip_7b else CASES):
        path, gpu = case[0], case[case.index("--gpu") + 1]
        if not path.endswith(".py"):  # (the Hugging Face folder row asks a model file's question again)
            continue
        before = timed_estimate(path, gpu, None, None, min_blocks=0, made_steps=False)
        one = alone(lambda: timed_estimate(path, gpu, None, None))  # noqa: B023 - called here
        rows.append(row(f"7B Llama, {what}", before, timed_estimate(path, gpu, None, None), None, one))
        print(rows[-1], file=sys.stderr)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    text = "\n".join([
        "### How fast the estimate answers",
        "",
        f"Command: `{shlex.join(['python', '-m', 'bench.bench_estimate_speed', *(argv or [])])}`  ",
        f"Machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, no GPU; {utc_now()}; load average {load} "
        "at the end.",
        "",
        f"One bare FakeTensorMode training step of GPT-2 small (micro-batch 4, context 1024, fp32, AdamW; warm, the "
        f"best of three): {bare:.2f} s. GPT-2 small's ladder as the estimate runs (in one process too): the best of "
        "three runs.",
        "",
        "| question | every trial traced whole | as the estimate runs, in one process | as the estimate runs | "
        "in bare steps (each column's) | plan | peak before, B | peak after, B | same plan and bytes |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |",
        *rows,
        "",
        "Before: GPT-2 small with `replays=False`, the 1B's with every context traced (no context curves), the 7B "
        "questions with `min_blocks=0, made_steps=False` (each trial traced whole, both steps run; the 7B's sizes "
        "still replayed). After: the defaults. The trial counts say how each figure was found: run (traced whole, "
        "both steps), first-step-run (the second step made from the first), replayed (from two sizes, or from four "
        "contexts), extrapolated (from 2, 3 and 4 repeated blocks; a rung's other micro-batches from 2 "
        "and 3, its template refitted). Each timed run starts as `oomtune estimate`'s process does once the model "
        "file is loaded: what it holds frozen (search/trial.py imports_settled; what earlier runs here left collected "
        "first). The bare step is torch's own FakeTensorMode, its cache keys too (the estimate lays them out in fewer "
        "calls: memory/cache_keys.py). As the estimate runs, a trial made from fewer "
        "blocks traces 2 of them first, then 3 in a forked copy of the process while this one traces 4 "
        "(search/fan_out.py; the floors too), and a model traced whole has each rung's micro-batch 1 traced in a "
        "copy while the rung's target is traced, from its second rung on (replayed_trials.py: a copy's micro-batch "
        "1 checks its own second step, so it counts as run, not first-step-run); in one process: the same with no "
        "copies, whose breakdown and plan must be the same to the byte. The 7B columns pass "
        "the rungs past accumulation whose floor does not fit (rung_floors.py, with their bounds; the floors made "
        "from 2, 3 and 4 blocks only after), make the 8-bit AdamW's fake chunks and NF4's dequantizations and "
        "quantizations from the first of their kind (memory/made_calls.py) and check the first loss on 2 blocks, "
        "so neither is the code before issue 40. Every column makes the optimizer phase (clipping, and torch's "
        "optimizer step on a trial's last step) from the first of its kind (memory/made_optim.py). "
        "The columns run in this one process (its copies apart), the "
        "defaults after the traced-whole and the one-process runs of the same question: its imports, FakeTensorMode's "
        "dispatch cache and the first-of-kind patterns are warm, so a cold `oomtune estimate` of the same question "
        "takes longer (make bench-levers, "
        "Python's start and imports included).",
    ])
    write_section(args.out, "estimate-speed", text, heading="## Estimate speed")
    print(f"wrote the estimate-speed section of {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
