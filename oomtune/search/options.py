"""What the searches (probe, estimate, check) are asked, checked before anything is loaded or run: the targets
(batch, context, min-context: flag, else the model file's DEFAULTS, else 32 x 512), headroom, steps, objective,
amp, ranks, and estimate's what-if options. Each bad value is one line naming where it came from."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from ..config.schema import PRECISIONS, TRIAL_STEPS
from ..dist.wrap import fsdp_unsupported
from ..errors import BAD_INPUT, MAX_COUNT, OomtuneError, shown
from ..model_file import ModelFile

OBJECTIVES = ("fit", "throughput")


AMP_CHOICES = ("auto", "bf16", "fp16")


# what the ladder may use, in the order it climbs: the usual rungs, then those past accumulation (cheapest first)
LEVERS = ("amp", "checkpointing", "accumulation", "fsdp", "chunked-loss", "step-in-backward", "bf16-true", "8bit",
          "nf4", "offload", "offload-activations")
COMPILE = "compile"  # not climbed: named (--levers ...,compile or --compile), every rung is compiled (plan.compile)


def parse_levers(text: str | None) -> frozenset[str]:
    """--levers amp,checkpointing,accumulation: the set the ladder may use (None: every lever; "none": no lever,
    the fp32 rung alone with the whole batch at once). The Python API may give the names as a list or set."""
    if text is None:
        return frozenset(LEVERS)
    if isinstance(text, (list, tuple, set, frozenset)) and all(isinstance(n, str) for n in text):
        text = ",".join(text) if text else "none"
    if not isinstance(text, str):
        raise OomtuneError(f"levers must be names like 'amp,checkpointing' (or a list of them), got {text!r}")
    if text.strip().lower() == "none":  # the fp32 rung alone, the whole batch at once
        return frozenset()
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise OomtuneError(f"--levers {text!r} names no lever: leave it out to allow every lever, or say none for "
                           "the fp32 rung alone")
    unknown = [n for n in names if n not in (*LEVERS, COMPILE)]
    if unknown:
        raise OomtuneError(f"--levers {text!r}: unknown {', '.join(unknown)} (expected names from "
                           f"{', '.join(LEVERS)}, {COMPILE}, comma-separated)")
    return frozenset(names)


def with_compile(levers: str | None, compile_: bool, one_plan: bool = False) -> str | None:
    """--levers as --compile extends it: every lever (or those named, or none) and compile; for one plan
    (estimate --micro-batch, where --levers names the levers past accumulation it uses), those and compile."""
    if not compile_:
        return levers
    if levers is None and one_plan:
        return COMPILE
    if levers is None:
        return ",".join((*LEVERS, COMPILE))
    return COMPILE if levers.strip().lower() == "none" else f"{levers},{COMPILE}"


def whole(value, where: str) -> int:
    """`value` where a count is asked (the Python API passes what it is given): an int, not a bool, a float or a
    string; one line naming `where` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # (numpy's integers are Integral)
        raise OomtuneError(f"{where} must be a whole number, got {shown(value)} ({type(value).__name__})")
    if abs(int(value)) > MAX_COUNT:  # (a 401-digit --steps ran for ever; a --batch overflowed inside torch)
        raise OomtuneError(f"{where} must be at most {MAX_COUNT:,}, got {shown(value)}")
    return int(value)


@dataclass(frozen=True)
class Targets:
    batch: int  # B: the global batch to keep exact
    context: int  # T: the context to reach
    min_context: int  # T_min: the shortest context the user accepts (default T: never cut)


def resolve_targets(model_file: ModelFile, batch: int | None, context: int | None,
                    min_context: int | None) -> Targets:
    """CLI values first, then the model file's DEFAULTS, then 32 x 512. A bad value is blamed on where it came
    from: the flag, or the model file's DEFAULTS (never a flag the user did not type)."""
    d = model_file.defaults
    given = {"batch": batch, "context": context, "min_context": min_context}
    b = batch if batch is not None else d.get("batch", 32)
    t = context if context is not None else d.get("context", 512)
    t_min = min_context if min_context is not None else d.get("min_context", t)

    def source(key: str) -> str:
        if given[key] is not None:
            return "--" + key.replace("_", "-")
        return f"{model_file.label} DEFAULTS[{key!r}]" if key in d else f"the default {key}"

    b, t, t_min = (whole(v, source(key)) for key, v in (("batch", b), ("context", t), ("min_context", t_min)))
    for key, v in (("batch", b), ("context", t), ("min_context", t_min)):
        if v < 1:
            raise OomtuneError(f"{source(key)} must be at least 1, got {v}")
    if t_min > t:
        raise OomtuneError(f"{source('min_context')} {t_min} is longer than {source('context')} {t}"
                           + (f" (give --min-context {t} or less)" if min_context is None else ""))
    if model_file.max_context is not None and t > model_file.max_context:
        raise OomtuneError(f"{source('context')} {t} is longer than {model_file.label} takes: at most "
                           f"{model_file.max_context} tokens (its max_position_embeddings, or MAX_CONTEXT)")
    return Targets(b, t, t_min)


def check_headroom(headroom: float, where: str = "--headroom") -> None:
    """`where` names where the value came from: the flag, or the config's key."""
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)):
        raise OomtuneError(f"{where} must be a number in [0, 1), got {headroom!r} ({type(headroom).__name__})")
    if not 0 <= headroom < 1:  # NaN fails this too
        raise OomtuneError(f"{where} must be in [0, 1), got {headroom}")


def check_steps(steps: int) -> None:
    """At least 2: the first step makes the optimizer state, and only a later step's forward and backward run
    beside it. One step reads a peak without it: a plan that does not fit would pass."""
    if whole(steps, "--steps") < 2:
        raise OomtuneError(f"--steps must be at least 2 (the optimizer state the first step makes is held through "
                           f"the next one's forward and backward), got {steps}")


def check_search_options(headroom: float, steps: int, objective: str, amp: str) -> None:
    """The options probe and estimate share, checked before anything is loaded (one line, exit 2)."""
    check_headroom(headroom)
    check_steps(steps)
    if objective not in OBJECTIVES:
        raise OomtuneError(f"--objective {objective!r}: expected one of {', '.join(OBJECTIVES)}")
    if amp not in AMP_CHOICES:
        raise OomtuneError(f"--amp {amp!r}: expected one of {', '.join(AMP_CHOICES)}")


def check_prior(prior: bool | str | None, kind: str, on_ranks: bool) -> None:
    """--prior certifies the estimate on one process of a device that is not the estimate's own; "auto" (the
    API's) first times whether it pays."""
    if prior not in (None, True, False, "auto"):
        raise OomtuneError(f"prior must be True, False, None or 'auto', got {shown(prior)}", BAD_INPUT)
    if prior and (on_ranks or kind == "fake"):
        raise OomtuneError("--prior certifies the estimate on one process of the cpu or cuda device: not on "
                           + ("several ranks" if on_ranks else "the fake device, whose probe is the estimate"))


def check_estimate_options(objective: str, headroom: float, steps: int = TRIAL_STEPS, amp: str = "auto") -> None:
    """check_search_options, and throughput refused: the fake device measures no speed."""
    if objective == "throughput":
        raise OomtuneError("--objective throughput ranks rungs by measured speed, and the fake device computes "
                           "nothing; run `oomtune probe --objective throughput` where the model can run", BAD_INPUT)
    check_search_options(headroom, steps, objective, amp)


def check_world(world_size: int, sharding: str | None) -> None:
    if whole(world_size, "--world-size") < 1:
        raise OomtuneError(f"--world-size must be at least 1, got {world_size}")
    if sharding is not None and sharding not in ("none", "ddp", "fsdp"):
        raise OomtuneError(f"--sharding {sharding!r}: expected none, ddp or fsdp")
    if sharding == "none" and world_size > 1:
        raise OomtuneError(f"--sharding none is one process: with --world-size {world_size} use ddp or fsdp")
    if sharding == "fsdp" and (why := fsdp_unsupported("cpu")) is not None:  # the fake device's tensors are cpu's
        raise OomtuneError(f"--sharding fsdp: {why}")


def check_what_if_options(micro_batch: int | None, precision: str | None, checkpointing: bool | None,
                          grad_accum: int | None, batch: int | None, min_context: int | None) -> bool:
    """estimate's what-if options: True when they ask for one plan (--micro-batch), False for the ladder."""
    plan_opts = {"--precision": precision, "--checkpointing": checkpointing, "--grad-accum": grad_accum}
    if micro_batch is None:
        given = [k for k, v in plan_opts.items() if v is not None]
        if given:
            raise OomtuneError(f"{', '.join(given)} {'describes' if len(given) == 1 else 'describe'} one plan: give "
                               "--micro-batch too (without --micro-batch, estimate runs the whole ladder)")
        return False
    for name, v in (("--batch", batch), ("--min-context", min_context)):
        if v is not None:
            raise OomtuneError(f"{name} is a ladder target; with --micro-batch the plan is --micro-batch x "
                               "--grad-accum at --context")
    if precision is not None and precision not in PRECISIONS:
        raise OomtuneError(f"--precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    for name, v in (("--micro-batch", micro_batch), ("--grad-accum", grad_accum)):
        if v is not None and whole(v, name) < 1:
            raise OomtuneError(f"{name} must be at least 1, got {v}")
    return True
