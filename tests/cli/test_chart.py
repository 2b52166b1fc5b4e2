"""The chart probe and estimate end with (cli/chart.py): trials as peak against micro-batch, the limit line."""

from __future__ import annotations

from oomtune.cli.chart import peak_chart
from oomtune.config.schema import TrialRecord

MiB = 1 << 20


def record(rung: str, b: int, peak: int | None, result: str = "fits") -> TrialRecord:
    precision = "fp32" if rung == "fp32" else "bf16-true" if rung.startswith("bf16-true") else "bf16"
    return TrialRecord(rung=rung, stage="batch", micro_batch_size=b, context_length=64, grad_accum_steps=1,
                       precision=precision, activation_checkpointing=rung in ("checkpointing", "fsdp"),
                       result=result, peak_bytes=peak, tokens_per_s=None, seconds=0.1)


def test_each_rungs_trials_the_oom_marks_and_the_limit_line_are_drawn():
    records = [record("fp32", 16, None, "oom"), record("fp32", 1, 2 * MiB), record("fp32", 4, 5 * MiB),
               record("amp", 1, 1 * MiB), record("amp", 8, 6 * MiB), record("amp", 9, 7 * MiB, "over-headroom")]
    text = peak_chart(records, 6 * MiB + 512 * 1024).plain
    rows = text.splitlines()
    limit = next(r for r in rows if "6.50 MiB |" in r)
    assert set(limit.split("|", 1)[1]) <= {"-", "o", "+", "."}  # the limit, with what lies on it
    assert rows[0].rstrip().endswith("x")  # micro-batch 16 ran out of memory: top row, right edge
    assert "o fp32" in text and "+ bf16 " in text and "x out of memory" in text  # named as the tables name them
    plotted = "".join(r.split("|", 1)[1] for r in rows if "|" in r)
    assert plotted.count("o") == 2 and plotted.count("+") >= 2


def test_no_chart_from_a_single_size():
    assert peak_chart([record("fp32", 16, 5 * MiB)], 10 * MiB) is None


def test_every_rung_of_the_longest_ladder_has_its_own_mark():
    rungs = ["fp32", "amp", "checkpointing", "bf16-true", "bf16-true+8bit", "bf16-true+8bit+offload",
             "bf16-true+8bit+offload+offload-activations", "bf16-true+8bit+offload+offload-activations+nf4", "fsdp"]
    records = [record(r, b, (i + b) * MiB) for i, r in enumerate(rungs) for b in (1, 2)]
    legend = peak_chart(records, 100 * MiB).plain.split("micro-batch 1 .. 2", 1)[1]
    labels = ["fp32", "bf16", "bf16+ckpt", *rungs[3:-1], "bf16+fsdp"]  # as the trials and ladder tables name them
    marks = [legend.split(f" {r}   ")[0].split()[-1] for r in labels]  # the mark just before each name
    assert len(set(marks)) == len(rungs), marks


def test_every_rung_label_names_its_precision():
    from oomtune.cli.console import rung_label

    assert rung_label("checkpointing", "fp16") == "fp16+ckpt" and rung_label("amp", "bf16") == "bf16"
    assert rung_label("chunked-loss", "bf16") == "bf16+chunked-loss"  # (its name says no precision)
    assert rung_label("chunked-loss+bf16-true", "bf16-true") == "chunked-loss+bf16-true"
    assert rung_label("bf16-true+chunked-loss+8bit", "bf16-true") == "bf16-true+chunked-loss+8bit"
