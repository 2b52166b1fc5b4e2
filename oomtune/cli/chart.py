"""A chart in the terminal: each rung's trials as peak memory against micro-batch, the line through each rung's two
largest fitting sizes, and the limit (the budget less the headroom) as a line across."""

from __future__ import annotations

from rich.text import Text

from .console import fmt_bytes, rung_label

MARKS = "o+*#@%&$=~^"  # one per rung, in ladder order (at most 9: fp32, amp, checkpointing, fsdp, 5 past those)
WIDTH, HEIGHT = 64, 14


def _points(records) -> dict[str, list[tuple[int, int | None]]]:
    """rung -> (micro-batch, peak; None where it ran out of memory) of its trials without accumulation, at the
    context the rung settled on (its last trial's)."""
    out: dict[str, list[tuple[int, int | None]]] = {}
    for rung in dict.fromkeys(r.rung for r in records):
        mine = [r for r in records if r.rung == rung and r.grad_accum_steps == 1]
        if mine:
            context = mine[-1].context_length
            label = rung_label(rung, mine[-1].precision)  # as the trials and ladder tables name it
            out[label] = [(r.micro_batch_size, r.peak_bytes if r.result != "oom" else None) for r in mine
                         if r.context_length == context]
    return out


def peak_chart(records, limit_bytes: int) -> Text | None:
    """The chart, or None with fewer than two sizes tried."""
    points = _points(records)
    sizes = [b for pts in points.values() for b, _ in pts]
    if len(set(sizes)) < 2:
        return None
    peaks = [p for pts in points.values() for _, p in pts if p is not None]
    top = max([limit_bytes, *peaks]) * 1.1
    right = max(sizes)
    grid = [[" "] * WIDTH for _ in range(HEIGHT)]

    def col(b: float) -> int:
        return min(WIDTH - 1, max(0, round((b - 1) / max(right - 1, 1) * (WIDTH - 1))))

    def row(p: float) -> int:
        return min(HEIGHT - 1, max(0, HEIGHT - 1 - round(p / top * (HEIGHT - 1))))

    limit_row = row(limit_bytes)
    grid[limit_row] = ["-"] * WIDTH
    for i, pts in enumerate(points.values()):
        fit = sorted((b, p) for b, p in pts if p is not None and p <= limit_bytes)
        if len(fit) >= 2:  # the line the search draws through the two largest sizes that fit
            (b0, p0), (b1, p1) = fit[-2:]
            for c in range(WIDTH):
                b = 1 + c * (right - 1) / (WIDTH - 1)
                r = row(p0 + (p1 - p0) * (b - b0) / (b1 - b0))
                if grid[r][c] in (" ", "-") and 0 < r < HEIGHT - 1:
                    grid[r][c] = "."
        for b, p in pts:
            grid[0 if p is None else row(p)][col(b)] = "x" if p is None else MARKS[i % len(MARKS)]
    text = Text()
    for r, line in enumerate(grid):
        label = (fmt_bytes(limit_bytes) if r == limit_row else
                 fmt_bytes(int(top * (HEIGHT - 1 - r) / (HEIGHT - 1))) if r in (0, HEIGHT - 1) else "")
        text.append(f"{label:>11} |", style="dim")
        text.append("".join(line) + "\n", style="bold red" if r == limit_row else None)
    text.append(f"{'':>11} +{'-' * WIDTH}\n{'':>13}micro-batch 1 .. {right}\n", style="dim")
    legend = "   ".join(f"{MARKS[i % len(MARKS)]} {rung}" for i, rung in enumerate(points))
    text.append(f"{'':>13}{legend}   x out of memory   . the line through the two largest that fit   "
                f"- the limit ({fmt_bytes(limit_bytes)})\n", style="dim")
    return text
