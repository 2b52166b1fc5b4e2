"""`make bench-autocast`: the estimate with and without a card's CUDA rules. (1) Per rung, for the examples and GPT-2
small: the fake device's peak under CPU rules with the flat default margin, against the card's rules and its own
margin. (2) What BERT-large's forward saves for backward at sequence length 512, op by op, under CPU rules and the
card's (CUDA autocast's policy, the attention and dropout kernels the card would run), fp32 and fp16 autocast; and
the whole trial's breakdown of each. Writes the `autocast` block of bench/RESULTS.md; docs/cuda-estimate.md
explains the numbers.

    .venv/bin/python -m bench.bench_autocast [--out bench/RESULTS.md] [--batch 8] [--card a100-80]

Every number written comes from this run.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.sections import write_section
from oomtune.units import utc_now

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench/models/hf_bert_large.py"
MiB = 1 << 20
# (precision, transformers' attention): its default SDPA in fp32 and fp16 autocast, and eager attention in fp16 (its
# softmax is an op of autocast's lists)
CASES = (("fp32", "sdpa"), ("fp16", "sdpa"), ("fp16", "eager"))


class _WeightCasts(TorchDispatchMode):
    """Storages of low-precision casts of the parameters (autocast's weight copies), seen as they are made."""

    def __init__(self, params: set[int]):
        super().__init__()
        self.params, self.casts = params, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and id(args[0].untyped_storage()) in self.params:
            self.casts.add(id(out.untyped_storage()))
        return out


def _saved(node) -> list[torch.Tensor]:
    """The tensors an autograd node saved for backward (built-in nodes' _saved_* attributes; custom Functions')."""
    out = []
    names = [n for n in dir(node) if n.startswith("_saved_")] or (["saved_tensors"] if hasattr(node, "saved_tensors")
                                                                   else [])
    for name in names:
        try:
            value = getattr(node, name)
        except RuntimeError:  # freed already
            continue
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, torch.Tensor):
                out.append(v)
    return out


def saved_by_op(loss: torch.Tensor, params: set[int], casts: set[int]) -> dict[tuple[str, str], int]:
    """(autograd node, dtype) -> bytes of the distinct storages saved for backward, each counted once (at the node
    that reaches it first from the loss), parameters left out and the weight casts under their own name."""
    from oomtune.memory.tracker import rounded

    seen: set[int] = set()
    keep: list = []  # the storages counted, alive until the walk ends (their ids stay theirs)
    table: dict[tuple[str, str], int] = defaultdict(int)
    stack, visited = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        for t in _saved(node):
            st = t.untyped_storage()
            key = id(st)
            if key in seen or key in params:
                continue
            seen.add(key)
            keep.append(st)
            op = "autocast weight copies" if key in casts else type(node).__name__.removesuffix("Backward0")
            table[(op, str(t.dtype).removeprefix("torch."))] += rounded(st.nbytes())
        stack.extend(fn for fn, _ in node.next_functions)
    return dict(table)


def one_forward(model_file, plan, device) -> dict[tuple[str, str], int]:
    """One training forward of `plan` on `device` (the trial's own build and autocast), what it saved, by op."""
    from oomtune.step import autocast, build_training, cast_inputs

    with device.measure():
        t = build_training(model_file, plan, device, lr=1e-4)
        params = {id(p.untyped_storage()) for p in t.model.parameters()}
        batch = model_file.batch(plan.micro_batch_size, plan.context_length, device.torch_device)
        with _WeightCasts(params) as watch, autocast(t):
            loss = model_file.loss(t.model, cast_inputs(batch, t.plan))
        return saved_by_op(loss, params, watch.casts)


def measure(batch: int, card_name: str) -> list[dict]:
    sys.path.insert(0, str(ROOT))
    from oomtune.config.schema import Plan
    from oomtune.memory.breakdown import breakdown
    from oomtune.memory.cards import find_gpu
    from oomtune.memory.devices import FakeDevice
    from oomtune.memory.margin import Margin
    from oomtune.model_file import load_model_file

    mf = load_model_file(ROOT / MODEL)
    card = find_gpu(card_name)
    rows = []
    for precision, attention in CASES:
        os.environ["BERT_ATTENTION"] = attention  # read by build_model
        for accounting, gpu in (("CPU", None), (f"CUDA ({card.name})", card)):
            plan = Plan(batch, 512, precision)
            start = time.perf_counter()
            device = FakeDevice("1TiB", gpu=gpu, margin=Margin())  # tensors only: the accounting is the question
            ops = one_forward(mf, plan, device)
            bd = breakdown(mf, plan, FakeDevice("1TiB", gpu=gpu, margin=Margin()))
            rows.append({"precision": precision + ("" if attention == "sdpa" else f" {attention}"),
                         "accounting": accounting, "ops": ops, "breakdown": bd, "seconds": time.perf_counter() - start})
            print(f"  {precision} {accounting}: saved {sum(ops.values()) / MiB:.0f} MiB, tensor peak "
                  f"{bd.tensor_peak_bytes / MiB:.0f} MiB ({rows[-1]['seconds']:.0f} s)", file=sys.stderr)
    return rows


RUNG_MODELS = ("examples/tiny_gpt.py", "examples/mlp_dict.py", "examples/conv_net.py", "bench/models/gpt2_small.py")
RUNGS = (("fp32", "fp32", False), ("amp", "amp", False), ("amp + ckpt", "amp", True))


def per_rung(card_name: str) -> list[dict]:
    """Each model at its DEFAULTS batch and context, each rung, on the fake device: CPU rules + the flat default
    margin (no card: what the estimate did before), and the card's rules + its margin."""
    from oomtune.config.schema import Plan
    from oomtune.memory.cards import find_gpu
    from oomtune.memory.devices import FakeDevice
    from oomtune.model_file import load_model_file
    from oomtune.search.trial import run_trial

    card = find_gpu(card_name)
    rows = []
    for path in RUNG_MODELS:
        mf = load_model_file(ROOT / path)
        b, t = mf.defaults["batch"], mf.defaults["context"]
        for rung, precision, ckpt in RUNGS:
            amp = "bf16" if card.bf16 else "fp16"
            plan = Plan(b, t, amp if precision == "amp" else precision, ckpt)
            start = time.perf_counter()
            cpu = run_trial(mf, plan, FakeDevice("1TiB"))
            cuda = run_trial(mf, plan, FakeDevice("1TiB", gpu=card))
            rows.append({"model": Path(path).stem, "plan": plan, "rung": rung, "cpu": cpu, "card": cuda,
                         "seconds": time.perf_counter() - start})
            print(f"  {Path(path).stem} {rung}: {cpu.peak_bytes / MiB:,.0f} -> {cuda.peak_bytes / MiB:,.0f} MiB",
                  file=sys.stderr)
    return rows


def rung_section(rows: list[dict], card_name: str) -> str:
    from oomtune.memory.cards import find_gpu
    from oomtune.memory.margin import parse_margin

    card, flat = find_gpu(card_name), parse_margin(None)
    lines = [f"### The estimate per rung, without and with {card.name}'s CUDA rules", "",
             f"Fake device, each model at its DEFAULTS batch and context. Without: CPU rules (CPU autocast, the "
             f"CPU's SDPA and dropout) and the flat margin {flat.describe()} (the estimate before card profiles). "
             f"With: the card's rules and its own margin ({parse_margin(f'card:{card.aliases[0]}').text()}). "
             "MiB; tensors is the tensor peak, peak what the estimate compares with the budget.", "",
             "| model | batch x ctx | rung | tensors, CPU rules | tensors, card rules | peak, before | peak, card "
             "| change |", "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        cpu, cuda, p = r["cpu"], r["card"], r["plan"]
        lines.append(f"| {r['model']} | {p.micro_batch_size}x{p.context_length} | {r['rung']} ({p.precision}) | "
                     f"{cpu.peak_allocated_bytes / MiB:,.1f} | {cuda.peak_allocated_bytes / MiB:,.1f} | "
                     f"{cpu.peak_bytes / MiB:,.1f} | {cuda.peak_bytes / MiB:,.1f} | "
                     f"{(cuda.peak_bytes - cpu.peak_bytes) / cpu.peak_bytes * 100:+.1f}% |")
    return "\n".join(lines)


def section(rows: list[dict], command: str, batch: int) -> str:
    mib = lambda n: f"{n / MiB:,.1f}"  # noqa: E731
    heads = [f"{r['precision']}, {r['accounting']}" for r in rows]
    lines = [
        "### CPU against CUDA autocast accounting: BERT-large at sequence length 512",
        "",
        "Fake tensors, "
        f"margin 0 (tensors only), a micro-batch of {batch} sequences, AdamW, dropout 0.1 (training mode); "
        "transformers' default SDPA attention, and its eager attention where the column says so.",
        "",
        "What one forward saves for backward, by the autograd node that saves it and the dtype saved (MiB; each "
        "storage counted once; weights left out, their autocast copies on a line of their own; lines under 0.1 MiB "
        "left out):",
        "",
        "| saved by | dtype | " + " | ".join(heads) + " |",
        "| --- | --- |" + " ---: |" * len(rows),
    ]
    keys = sorted({k for r in rows for k, n in r["ops"].items() if n >= MiB // 10},  # (under 0.1 MiB: left out)
                  key=lambda k: (-max(r["ops"].get(k, 0) for r in rows), k))
    for op, dtype in keys:
        lines.append(f"| {op} | {dtype} | " + " | ".join(mib(r["ops"].get((op, dtype), 0)) for r in rows) + " |")
    lines.append("| **all saved** | | " + " | ".join(f"**{mib(sum(r['ops'].values()))}**" for r in rows) + " |")
    lines += ["", "The whole trial (two optimizer steps), its breakdown's parts (MiB):", "",
              "| part | " + " | ".join(heads) + " |", "| --- |" + " ---: |" * len(rows)]
    for part in ("parameters", "gradients", "optimizer_state", "autocast_copies", "activations", "temporaries"):
        lines.append(f"| {part.replace('_', ' ')} | " +
                     " | ".join(mib(r["breakdown"].part_bytes()[part]) for r in rows) + " |")
    lines.append("| **tensor peak** | " + " | ".join(f"**{mib(r['breakdown'].tensor_peak_bytes)}**" for r in rows)
                 + " |")
    lines.append("| peak in | " + " | ".join(r["breakdown"].phase for r in rows) + " |")
    lines.append("| seconds (this run) | " + " | ".join(f"{r['seconds']:.0f}" for r in rows) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "RESULTS.md")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--card", default="a100-80")
    args = ap.parse_args(argv)
    command = shlex.join(["python", "-m", "bench.bench_autocast", "--batch", str(args.batch), "--card", args.card])
    rungs = per_rung(args.card)
    rows = measure(args.batch, args.card)
    head = (f"Command (from the repository root): `{command}`  \nMachine: {os.cpu_count()} CPU cores, torch "
            f"{torch.__version__}, no GPU; {utc_now()}.")
    body = "\n\n".join((head, rung_section(rungs, args.card), section(rows, command, args.batch)))
    write_section(args.out, "autocast", body, "## CUDA-faithful estimate")
    print(f"wrote the autocast block of {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
