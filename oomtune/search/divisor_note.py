"""Why a plan's micro-batch sits well below what fits: a global batch with no divisor in between, or one whose
accumulation did not fit (the probe's divisor note)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .ladder import Rung, largest_divisor_at_most

if TYPE_CHECKING:
    from .probe import ProbeResult


def divisor_note(result: ProbeResult) -> str | None:
    """Where the plan's micro-batch is well below the largest that fits (within a factor of two: nothing to say),
    say why: the global batch has no divisor in between (B=17 with 8 fitting runs as 1 x 17; then name the nearest
    global batch that would run at what fits), or it has one, but that micro-batch with accumulation did not fit
    (accumulation keeps every gradient alive through the next micro-step). Under the fit objective "what fits" is
    the largest micro-batch of any rung at the plan's context (the plan is the largest any rung verified); under
    throughput, the chosen rung's."""
    ladder, c = result.ladder, result.ladder.choice
    if result.config is None or c is None:
        return None
    at = [r for r in ladder.rungs if r.found and r.context_length == c.context_length]  # (a context cut for the plan)
    if result.config.found_by.objective != "throughput" and at:
        top = max(at, key=lambda r: r.micro_batch_size)
    else:
        top = next((r for r in at if r.rung == c.rung), None)
    fitting, fit_rung = (top.micro_batch_size, top.rung) if top is not None else (0, c.rung)
    alone = max((r.micro_batch_size for r in result.records if r.result == "fits" and r.grad_accum_steps == 1
                 and r.rung == c.rung.name and r.context_length == c.context_length), default=0)
    if alone > fitting:  # the context was cut for the accumulated plan: the rung's own search was at a longer one
        fitting, fit_rung = alone, c.rung
    if c.micro_batch_size * 2 > fitting:
        return None
    chosen, accum = c.micro_batch_size, c.grad_accum_steps
    on = "" if fit_rung == c.rung else f" ({describe_rung(fit_rung)})"
    world, batch = result.world_size, result.targets.batch
    per_rank = batch // world
    divisor = largest_divisor_at_most(per_rank, fitting)
    if divisor > chosen:
        return (f"micro-batch {fitting} fits{on}, but {divisor} x {per_rank // divisor} with accumulation does not "
                f"(accumulation keeps every gradient alive through the next micro-step): it runs as {chosen} x "
                f"{accum}")
    nearest = max(fitting, round(batch / world / fitting) * fitting) * world
    k = nearest // world // fitting  # (k > 1: accumulation keeps gradients alive, unmeasured: it may not fit)
    what = "was measured to fit" if k == 1 else "may fit, where its accumulation does: probe it to know"
    return (f"micro-batch {fitting} fits{on}, but the global batch {batch} has no divisor between {chosen + 1} and "
            f"{fitting}{' per rank' if world > 1 else ''}: it runs as {chosen} x {accum}; "
            f"--batch {nearest} as {fitting} x {k} {what}")


def describe_rung(rung: Rung) -> str:
    """A rung in words for a note: its precision and what it adds ("bf16, checkpointing")."""
    return ", ".join([rung.precision] + [w for w, on in (("checkpointing", rung.activation_checkpointing),
                                                          ("8-bit AdamW", rung.optimizer_8bit),
                                                          ("NF4 weights", rung.nf4_frozen_weights),
                                                          ("optimizer offload", rung.offload_optimizer),
                                                          ("activation offload", rung.offload_activations),
                                                          ("chunked cross-entropy", rung.chunked_loss),
                                                          ("optimizer in backward", rung.optimizer_in_backward))
                                                         if on])
