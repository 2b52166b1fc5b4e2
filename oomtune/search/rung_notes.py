"""Notes on what a rung turned out to measure, read from the ladder's trials after the climb."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..memory.breakdown import StaticMemory
from .ladder import Rung, Trial

SAME_SIZES = 2  # sizes both rungs measured, at the least, before their equal peaks say checkpointing saved nothing


def checkpointing_saved_nothing(label: str, rungs: Sequence[Rung], trials: Sequence[Trial],
                                static: StaticMemory, trial: object = None) -> tuple[str, ...]:
    """A note where a checkpointing rung's peaks equal the rung's before it (the same but for checkpointing) at every
    size both measured (SAME_SIZES at least): what it wraps holds none of the activations (a forward that calls its
    blocks' parts, not the blocks; a model's own switch that does nothing), and its plan costs recompute for no
    memory. `trial`: the search's trials; where it has `peak_of(point)` (the estimate's: a target recorded out of
    memory without a trace, traced now), it is asked only where the sizes measured agree but are too few."""
    peak_of = getattr(trial, "peak_of", None)
    for before, rung in zip(rungs, rungs[1:], strict=False):
        if not rung.activation_checkpointing or before.activation_checkpointing:
            continue
        peaks = [_peaks(trials, r) for r in (before, rung)]
        same = sorted(set(peaks[0]) & set(peaks[1]))
        if 0 < len(same) < SAME_SIZES and peak_of is not None and all(peaks[0][k] == peaks[1][k] for k in same):
            peaks = [_peaks(trials, r, peak_of) for r in (before, rung)]
            same = sorted(set(peaks[0]) & set(peaks[1]))
        if len(same) < SAME_SIZES or any(peaks[0][k] != peaks[1][k] for k in same):
            continue
        what = (f"the {static.blocks_wrapped} it wraps" if static.checkpointing_via == "blocks" else
                "the model's own checkpointing switch")
        contexts = {t for _, t, _ in same}
        sizes = ", ".join((f"{b}x{a}" if a > 1 else str(b)) + ("" if len(contexts) == 1 else f" at context {t}")
                          for b, t, a in same) + (f" at context {same[0][1]}" if len(contexts) == 1 else "")
        return (f"the {rung.name} rung saved nothing: at every size both it and the {before.name} rung measured "
                f"(micro-batch {sizes}), its peak equals the {before.name} rung's to the byte, "
                f"so {what} hold none of the activations; define blocks(model) in {label} returning the modules "
                "the forward calls, one or a few per layer (e.g. each layer's attention and feed-forward)",)
    return ()


def _peaks(trials: Sequence[Trial], rung: Rung, peak_of: Callable | None = None) -> dict[tuple[int, int, int], int]:
    """(micro-batch, context, accumulation) -> the peak measured there on `rung` (or given by `peak_of`)."""
    peaks = {(t.point.micro_batch_size, t.point.context_length, t.point.grad_accum_steps):
             t.measurement.peak_bytes if t.measurement.peak_bytes is not None or peak_of is None else peak_of(t.point)
             for t in trials if t.point.rung == rung}
    return {k: v for k, v in peaks.items() if v is not None}
