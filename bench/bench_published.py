"""`make bench-published`: `oomtune estimate` against peak memory that others published from real GPUs, each recipe
modelled as it ran, as far as oomtune's plan can express it.

torchtune's two README tables (../shared/truth/torchtune-tables.md): an equivalent Hugging Face config
(examples/hf/llama-2-7b, examples/hf/llama-3.2-3b: the published models' shapes), the recipe's LoRA settings,
precision, checkpointing, batch, context and levers. torch.compile is `--compile` (each layer and the loss compiled,
as torchtune's recipes compile since late 2024). Where torchtune's model code keeps other memory than Hugging
Face's, a model file here says so (bench/models/torchtune_*.py: torchtune's output layer upcasts the whole logits to
fp32 in eager where the loss is not chunked; the May 2024 QLoRA recipe's loss was computed outside its compiled
model; its Llama 3.2 QLoRA builder stores only the adapted projections in NF4, k_proj stays bf16). What oomtune
cannot express yet (the streams of torchtune's activation offloading, a whole-model compile) is named in the row,
not fitted: the error stands.
Chunked cross-entropy is oomtune's `chunked-loss` lever, the optimizer step fused into backward its
`step-in-backward` lever, and AdamW fused (torchtune's recipes' `fused: True`) oomtune's default optimizer.

litgpt's single-GPU resource tables (October 2023): litgpt's own model code (bench/models/litgpt_*.py).

The figure compared is the published one's kind: "reserved" (torch.cuda.max_memory_reserved: oomtune's modelled
caching-allocator reservation, no CUDA context) or "active" (active_bytes.all.peak: oomtune's tensor peak, 512-byte
blocks, of the training step's phases: torchtune's get_memory_stats resets the peak once the model is built, so its
logged peak leaves the build out), "allocated" (torch.cuda.max_memory_allocated over the whole run, as litgpt prints
it: oomtune's tensor peak, the build included) or "oom" (the run ran out of memory: oomtune's peak, the CUDA context
and the allocator model included, must pass the card's memory). Written to bench/RESULTS.md between
`<!-- published:begin -->` and `<!-- published:end -->`.

    .venv/bin/python -m bench.bench_published [--out bench/RESULTS.md] [--only C1,C3]

Every number written comes from this run.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.bench_levers import run_case
from bench.sections import write_section
from oomtune.units import utc_now

ROOT = Path(__file__).resolve().parent.parent
GB, GiB = 10**9, 2**30
LLAMA2_7B, LLAMA32_3B = "examples/hf/llama-2-7b", "examples/hf/llama-3.2-3b"
QVO_MLP = "q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
TORCHTUNE_3B = "bench/models/torchtune_llama3_2_3b.py"  # (its logits upcast in the model, as torchtune's)
TORCHTUNE_7B_QLORA = "bench/models/torchtune_llama2_7b_qlora.py"  # (and its loss eager, outside the model)
TORCHTUNE_3B_QLORA = "bench/models/torchtune_llama3_2_3b_qlora.py"  # (NF4 where torchtune's builder puts it)
FULL_3B = [LLAMA32_3B, "--gpu", "a100-80", "--micro-batch", "2", "--context", "4096", "--precision", "bf16-true"]
OFFLOAD = ("activation offloading: oomtune's (torchtune's streams keep each tensor on the device until its copy is "
           "done, and fetch the next back early in backward)")
LORA_3B = [*FULL_3B, "--checkpointing", "--lora-r", "64", "--lora-alpha", "128", "--lora-targets", QVO_MLP]


@dataclass(frozen=True)
class Row:
    id: str
    recipe: str
    published: int  # bytes
    shown: str  # as published
    kind: str  # "reserved" | "active" | "allocated" | "oom" (the run ran out of memory: `published` is the card's)
    args: tuple[str, ...]  # after `oomtune estimate`
    not_expressed: str = ""  # what the recipe did that the plan cannot say yet


ROWS = (
    Row("C1", "Llama2-7B LoRA (RTX 4090)", int(21.3 * GB), "21.3 GB", "reserved",
        (LLAMA2_7B, "--gpu", "rtx4090", "--micro-batch", "4", "--context", "2048", "--precision", "bf16-true",
         "--checkpointing", "--lora-r", "8", "--lora-alpha", "16", "--lora-dropout", "0.05",
         "--lora-targets", "q_proj,v_proj")),
    Row("C2", "Llama2-7B QLoRA (RTX 4090)", int(12.3 * GB), "12.3 GB", "reserved",
        (TORCHTUNE_7B_QLORA, "--gpu", "rtx4090", "--micro-batch", "4", "--context", "2048", "--precision",
         "bf16-true", "--checkpointing", "--levers", "nf4", "--compile"),
        "the recipe compiled the whole model (its loss eager, as here): here each layer"),
    Row("C3", "Llama3.2-3B full, packed", int(60.0 * GiB), "60.0 GiB", "active", (TORCHTUNE_3B, *FULL_3B[1:])),
    Row("C3c", "+ compile", int(51.0 * GiB), "51.0 GiB", "active", (TORCHTUNE_3B, *FULL_3B[1:], "--compile")),
    Row("C3k", "+ chunked cross-entropy", int(42.9 * GiB), "42.9 GiB", "active",
        (*FULL_3B, "--levers", "chunked-loss", "--compile")),
    Row("C4", "+ activation checkpointing", int(24.9 * GiB), "24.9 GiB", "active",
        (*FULL_3B, "--checkpointing", "--levers", "chunked-loss", "--compile")),
    Row("C4o", "+ optimizer step in backward", int(23.1 * GiB), "23.1 GiB", "active",
        (*FULL_3B, "--checkpointing", "--levers", "chunked-loss,step-in-backward", "--compile")),
    Row("C5", "Llama3.2-3B LoRA", int(8.5 * GiB), "8.5 GiB", "active",
        (*LORA_3B, "--levers", "chunked-loss,offload-activations", "--compile"),
        OFFLOAD),
    Row("C6", "Llama3.2-3B QLoRA", int(4.6 * GiB), "4.6 GiB", "active",
        (TORCHTUNE_3B_QLORA, *LORA_3B[1:LORA_3B.index("--lora-r")], "--levers", "chunked-loss,offload-activations",
         "--compile"), OFFLOAD),
)

# litgpt's resource tables (tutorials/resource-tables.md, October 2023): its single-GPU fine-tuning scripts on one
# A100 40GB, bf16-true, Alpaca (its longest sample, 1304 Llama 2 tokens, is the step that peaks), "Max GPU RAM" =
# torch.cuda.max_memory_allocated() / 1e9 over the whole run (the build included). litgpt's own model code
# (bench/models/litgpt_finetune.py; litgpt_nf4*.py: Fabric's bitsandbytes 4-bit precision, as that run had it).
LITGPT = ("--gpu", "a100-40", "--context", "1304", "--precision", "bf16-true")
QUANTIZED = {None: "litgpt_finetune", "bnb.nf4": "litgpt_nf4", "bnb.nf4-dq": "litgpt_nf4_dq"}


def _litgpt(id_, size, method, quantize, micro_batch, gb=None):
    """A row of litgpt's table: `gb` its figure, None where the run ran out of memory."""
    recipe = f"Llama2-{size} {method}{', ' + quantize if quantize else ''}, micro-batch {micro_batch}"
    args = (f"bench/models/{QUANTIZED[quantize]}.py", *LITGPT, "--micro-batch", str(micro_batch),
            *(("--model-arg", f"method={method}") if method != "lora" else ()),
            *(("--model-arg", "name=Llama-2-13b-hf") if size == "13B" else ()))
    if gb is None:
        return Row(id_, recipe, 40 * GiB, "OOM", "oom", args)
    said = ("bitsandbytes 0.41.1's kept 4-bit inputs: the model file keeps them; not: Fabric's StableEmbedding, "
            "bnb's paged AdamW" if quantize else "")
    return Row(id_, recipe, int(gb * GB), f"{gb:.2f} GB", "allocated", args, said)


LITGPT_ROWS = (
    _litgpt("L1", "7B", "lora", None, 1, 21.30),
    _litgpt("L2", "7B", "lora", None, 2, 29.07),
    _litgpt("L3", "7B", "lora", None, 4),
    _litgpt("L4", "7B", "lora", "bnb.nf4", 1, 14.14),
    _litgpt("L5", "7B", "lora", "bnb.nf4-dq", 1, 13.84),
    _litgpt("L6", "13B", "lora", None, 1, 38.12),
    _litgpt("L7", "13B", "lora", None, 2),
    _litgpt("L8", "13B", "lora", "bnb.nf4", 1, 23.14),
    _litgpt("L9", "13B", "lora", "bnb.nf4-dq", 1, 22.55),
    _litgpt("L10", "7B", "adapter", None, 1, 19.98),
    _litgpt("L11", "7B", "adapter", "bnb.nf4", 1, 12.68),
    _litgpt("L12", "7B", "adapter", "bnb.nf4-dq", 1, 12.38),
    _litgpt("L13", "7B", "adapter_v2", None, 1, 25.51),
    _litgpt("L14", "7B", "adapter_v2", "bnb.nf4", 1, 18.30),
    _litgpt("L15", "7B", "adapter_v2", "bnb.nf4-dq", 1, 17.98),
)


def estimate(row: Row) -> tuple[dict, float, list[str]]:
    return run_case(list(row.args), None)  # (a what-if: one plan, no config written)


def ours(row: Row, report: dict) -> int:
    bd = report["breakdown"]
    return {"reserved": bd["modelled_reserved_bytes"], "allocated": bd["tensor_peak_bytes"],
            "oom": bd["peak_bytes"]}.get(row.kind, bd["step_peak_bytes"])


def within(row: Row, n: int) -> bool:
    """Within the goal: -5%..+10% of the published figure; for a run that ran out of memory, a modelled peak (the
    CUDA context and the caching allocator's rounding included) past the card's memory."""
    return n > row.published if row.kind == "oom" else -0.05 <= n / row.published - 1 <= 0.10


def error(row: Row, n: int) -> str:
    """oomtune's figure against the published one: the relative error, or for a run that ran out of memory whether
    the modelled peak is past the card."""
    if row.kind == "oom":
        return "over the card" if n > row.published else "fits"
    return f"{n / row.published - 1:+.1%}"


def shown(n: int, row: Row) -> str:
    if row.kind in ("allocated", "oom"):
        return f"{n / GB:.2f} GB"
    return f"{n / GB:.1f} GB" if row.shown.endswith(" GB") else f"{n / GiB:.1f} GiB"


def table(results: list[tuple[Row, dict, float, list[str]]]) -> list[str]:
    header = ["id", "recipe", "published", "kind", "oomtune", "error", "within -5%..+10%", "not expressed",
              "command", "wall s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for row, report, wall, command in results:
        n = ours(row, report)
        eager = [note.split(":")[0] for note in report.get("notes", []) if note.startswith("compiled ")]
        said = "; ".join([*([row.not_expressed] if row.not_expressed else []),
                          *([f"ran eager: {', '.join(eager)}"] if eager else [])])
        lines.append("| " + " | ".join(cell.replace("|", "/") for cell in (
            row.id, row.recipe, row.shown, row.kind, f"{shown(n, row)} ({n:,} B)", error(row, n),
            "yes" if within(row, n) else "no", said or "-", f"`{shlex.join(command)}`",
            f"{wall:.0f}")) + " |")
    return lines


def section(results) -> str:
    import torch

    inside = [r.id for r, rep, _, _ in results if within(r, ours(r, rep))]
    torchtune = [r for r, _, _, _ in results if r.id.startswith("C")]
    return "\n".join([
        f"Written by `make bench-published` (`python -m bench.bench_published`) on {utc_now()}, torch "
        f"{torch.__version__}, on this machine's CPU (fake tensors, the card's rules). Published figures: torchtune's "
        "README tables (../shared/truth/torchtune-tables.md; C1-C2 one RTX 4090, C3-C6 one A100-80GB) and litgpt's "
        "resource tables (its tutorials/resource-tables.md, October 2023: L1-L15 one A100 40GB, its LoRA, Adapter and "
        "Adapter v2 scripts; its multi-GPU table, FSDP, is not modelled here). "
        "Each torchtune recipe is modelled with a Hugging Face Llama config of the published model's shape and the "
        "recipe's settings (C2, C3, C3c: with torchtune's fp32 logits and its loss outside the model, eager: C3c's "
        "recipe compiled its layers and dropped its compiled loss; C6: its NF4 layers; "
        "bench/models/torchtune_*.py); each litgpt one with litgpt's own model code, LoRA layers, chunked output "
        "and loss (bench/models/litgpt_*.py: litgpt 0.5.13's code, not the October 2023 commit measured; the 4-bit "
        "rows declare bitsandbytes' layout as Fabric's BitsandbytesPrecision applies it, every Linear). What the plan "
        "cannot express is named, and estimated without it (no correction applied). Kinds: reserved "
        "(max_memory_reserved: oomtune's modelled reservation, no CUDA context), active (active_bytes.all.peak of the "
        "step: oomtune's step tensor peak), allocated (max_memory_allocated over the whole run: oomtune's tensor "
        "peak, the build included), OOM (the run ran out of memory: oomtune's peak, context and allocator included, "
        "must pass the card's 40 GiB).",
        "",
        *table(results),
        "",
        f"Within the goal (-5%..+10%; OOM rows: over the card): {len([i for i in inside if i.startswith('C')])} of "
        f"{len(torchtune)} torchtune rows, {len([i for i in inside if i.startswith('L')])} of "
        f"{len(results) - len(torchtune)} litgpt rows.",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "RESULTS.md")
    ap.add_argument("--only", default="", help="comma-separated row ids (default: every row; writes nothing)")
    args = ap.parse_args(argv)
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    rows = [r for r in (*ROWS, *LITGPT_ROWS) if not only or r.id in only]
    results = []
    for i, row in enumerate(rows):
        print(f"[{i + 1}/{len(rows)}] {row.id}: oomtune estimate {shlex.join(row.args)}", file=sys.stderr, flush=True)
        report, wall, command = estimate(row)
        results.append((row, report, wall, command))
        n = ours(row, report)
        print(f"    {wall:.0f} s: {shown(n, row)} vs {row.shown} ({error(row, n)}; within the goal: "
              f"{'yes' if within(row, n) else 'no'})", file=sys.stderr, flush=True)
    if only:
        print("\n".join(table(results)))
        return 0
    write_section(args.out, "published", section(results), heading="## Published fine-tuning runs")
    print(f"wrote the published section of {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
