"""The estimator: the probe's ladder on the fake device plus the breakdown of what it chose (or, when nothing
fits, of the smallest plan, with the reason and the levers that would help); `what_if` for one plan."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..config.schema import HEADROOM, TRIAL_STEPS, Config, MemoryBreakdown, Plan, TrialRecord
from ..dist.group import LOCAL, fake_world
from ..errors import OomtuneError
from ..levers.nf4_bnb import declared_note
from ..memory.advice import levers_that_help, why_nothing_fits
from ..memory.breakdown import breakdown, recorded_trial, static_memory
from ..memory.cards import GENERIC, find_gpu
from ..memory.compiled import compile_notes
from ..memory.cuda_attention import kernel_notes
from ..memory.devices import Device, FakeDevice
from ..memory.fakes import NeedsValues
from ..memory.margin import AnyMargin, parse_margin
from ..model_file import ModelFile, own_compile_note
from ..units import card_budget, card_memory
from .batch_notes import batch_notes
from .extrapolate import BlockTrials
from .headroom_note import over_headroom
from .ladder import LadderResult, Point, Rung
from .options import (
    COMPILE,
    LEVERS,
    check_estimate_options,
    check_headroom,
    check_steps,
    check_world,
    parse_levers,
    resolve_targets,
)
from .past import PAST_LEVERS, PastRungs, past_rungs
from .prior import prior_device
from .probe import ProbeResult, all_rungs, fsdp_reach, no_fsdp_note, plan_of, probe
from .replayed_trials import ReplayedTrials
from .rung_floors import RungFloors
from .trial import TrialResult, computing_where_needed, run_trial
from .weights_dtype import precision_note


@dataclass
class EstimateResult:
    search: object  # probe.ProbeResult: the ladder, its trials and the config (None when nothing fits)
    margin: AnyMargin
    breakdown: MemoryBreakdown  # of the chosen plan, or of the smallest plan when nothing fits
    breakdown_plan: Plan
    levers: list[str] = field(default_factory=list)

    @property
    def config(self) -> Config | None:
        return self.search.config

    @property
    def plan(self) -> Plan | None:
        """The plan found (None when nothing fits: `breakdown_plan` is then the smallest plan, `breakdown` its)."""
        return self.config.plan if self.config is not None else None


class RecordingTrials:
    """The probe's trials, each with a Recorder on the tracker: the chosen plan's breakdown is that of the trial
    that chose it, not of a trial run again for it."""

    def __init__(self):
        self.breakdowns: dict[Plan, MemoryBreakdown] = {}

    def __call__(self, model_file: ModelFile, plan: Plan, device: FakeDevice, steps: int, dist) -> TrialResult:
        result, bd = recorded_trial(model_file, plan, device, steps, dist, run_trial)
        if bd is not None:
            self.breakdowns[plan] = bd
        return result


def make_fake_device(budget: str | None, gpu: str | None, margin: str | None) -> FakeDevice:
    """--budget / --gpu / --margin -> the fake device that stands in for that GPU: without --gpu, a card of the
    budget's memory with the generic profile's rules (cards.GENERIC); without --margin, the card's own margin.
    --gpu without --budget is the card's memory (the generic card has none); a budget is no more than it."""
    spec = find_gpu(gpu) if gpu else None
    if budget is None:
        if spec is None:
            raise OomtuneError("say how much memory to fit in: --budget 24GiB or --gpu NAME (e.g. --gpu a100-80)")
        card_memory(spec, gpu)
    elif spec is not None:
        card_budget(budget, spec)
    return FakeDevice(budget, gpu=spec or GENERIC, margin=parse_margin(margin) if margin is not None else None)


def smallest_plan(targets, rungs: list[Rung], world_size: int = 1, past: PastRungs | None = None) -> Plan:
    """The ladder's most frugal plan: micro-batch 1 at the shortest context allowed, on the last rung (past
    accumulation, where it has such rungs: every lever applied; else the last of the usual `rungs`)."""
    chain = [r for r in past.rungs if not r.optimizer_in_backward] if past is not None else []  # (its plan: the
    last = (chain or rungs)[-1]  # whole batch, never micro-batch 1 of a larger one)
    return plan_of(Point(last, 1, targets.min_context), world_size)


def estimate(model_file: ModelFile, device: FakeDevice, targets, *, headroom: float = HEADROOM,
             steps: int = TRIAL_STEPS, objective: str = "fit", amp: str = "auto", on_start: Callable | None = None,
             on_trial: Callable[[TrialRecord], None] | None = None, world_size: int = 1,
             sharding: str | None = None, levers: frozenset[str] = frozenset(LEVERS),
             replays: bool = True, min_blocks: int | None = None, made_steps: bool = True) -> EstimateResult:
    """The probe's ladder on the fake device, then the breakdown of its choice (see module doc).

    On `world_size` ranks the ladder runs in a fake process group (torch's `fake` backend: collectives do
    nothing) on rank 0, with FSDP2's own code: sharded weights, gradients and optimizer state, the units'
    gathered weights, full activations (DDP cannot wrap fake tensors: its reducer's buckets are added instead).
    `sharding` puts every rung on ddp or fsdp; by default the ladder replicates (ddp) and adds an fsdp rung.
    `replays`: replay sizes and extrapolate blocks where they line up (ReplayedTrials), from models of at least
    `min_blocks` repeated blocks (extrapolate.MIN_BLOCKS; 0: never), and with `made_steps`, make a trial's second
    step from its first where that was checked (second_steps.py)."""
    check_estimate_options(objective, headroom, steps, amp)
    check_world(world_size, sharding)
    ranks = (fake_world(world_size) if world_size > 1 or sharding in ("ddp", "fsdp")
             else contextlib.nullcontext(LOCAL))
    told = _once(on_trial)  # a rerun computing on the cpu (computing_where_needed) repeats the trials it told of
    with ranks as d:
        result, computed = computing_where_needed(device, model_file.label, lambda: _estimate(
            model_file, device, targets, headroom, steps, objective, amp, on_start, told, d, sharding, levers,
            replays, (min_blocks, made_steps)))
    result.search.notes += computed  # where the breakdown needed the values (the probe notes its own ladder's)
    return result


def _once(on_trial: Callable[[TrialRecord], None] | None) -> Callable[[TrialRecord], None] | None:
    """`on_trial`, told of each trial once: the same plan with the same result and peak is not told again."""
    if on_trial is None:
        return None
    seen: set[tuple] = set()

    def told(rec: TrialRecord) -> None:
        key = (rec.rung, rec.micro_batch_size, rec.context_length, rec.grad_accum_steps, rec.result, rec.peak_bytes)
        if key not in seen:
            seen.add(key)
            on_trial(rec)

    return told


def _estimate(model_file, device, targets, headroom, steps, objective, amp, on_start, on_trial, dist,
              sharding, levers, replays, blocks_and_steps) -> EstimateResult:
    world = dist.world_size
    limit = int(device.budget_bytes * (1 - headroom))
    recording = RecordingTrials()
    static = static_memory(model_file)
    sharded_by, no_fsdp = fsdp_reach(device, world, sharding)
    min_blocks = blocks_and_steps[0]
    blocks = ((BlockTrials(min_blocks or 1 << 30) if min_blocks is not None else BlockTrials())
              .knowing(static.repeated_blocks) if replays else None)
    floors = RungFloors(model_file, static, blocks)  # the past rungs' floors, measured once (floor_static's, the
    # ladder's; from fewer blocks where the model repeats enough of them)
    rungs, past, floor = all_rungs(model_file, device, amp, static, world, sharding, levers,
                                   device.margin.tensor_budget(limit), sharded_by, floors=floors)  # less the margin
    if device.margin.total(floor.floor_bytes // sharded_by) > limit:
        # nothing can fit: skip the ladder (every trial would run out) and explain with the smallest plan
        search = ProbeResult(LadderResult((), None, ()), [], static, targets, limit, None, world_size=world,
                             budget_bytes=device.budget_bytes, notes=past.notes(), past=past, too_small=True)
    else:
        search = None
        if dist.world_size == 1 and replays:
            search = _replayed(model_file, device, targets, headroom, steps, objective, amp, on_start, on_trial,
                               levers, (static, floor), recording, (blocks, blocks_and_steps[1]), floors)
        if search is None:
            search = probe(model_file, device, targets, headroom=headroom, steps=steps, objective=objective,
                           amp=amp, command="estimate", on_start=on_start, on_trial=on_trial, dist=dist,
                           sharding=sharding, levers=levers, statics=(static, floor), trial=recording,
                           floors=floors)
    if search.config is not None:
        plan = search.config.plan
        bd = recording.breakdowns.get(plan) or breakdown(model_file, plan, device, steps, dist)
        found_by = dataclasses.replace(search.config.found_by, breakdown=bd)
        search.config = dataclasses.replace(search.config, found_by=found_by)
        return EstimateResult(search, device.margin, bd, plan)
    plan = smallest_plan(targets, rungs, world, past)
    bd = breakdown(model_file, plan, device, steps, dist)
    if any(r.found for r in search.ladder.rungs):  # the smallest plan fits: the global batch is what cannot be
        return EstimateResult(search, device.margin, bd, plan)  # reached (the search's own reason says how)
    why = why_nothing_fits(bd, plan, floor, limit, device.budget_bytes, headroom, device.margin)
    search.over_headroom = over_headroom([(plan.describe(with_global=False), bd.peak_bytes)], device.budget_bytes,
                                         headroom) or search.over_headroom  # (the smallest plan's, as `why` says)
    why += f". {search.over_headroom.text()}" if search.over_headroom else ""
    search.why_nothing_fits = why + ("." if no_fsdp and not why.endswith(".") else "") + no_fsdp_note(no_fsdp)
    return EstimateResult(search, device.margin, bd, plan,
                          levers_that_help(bd, floor, limit, device.margin, headroom, plan, past))


def _replayed(model_file, device, targets, headroom, steps, objective, amp, on_start, on_trial, levers, statics,
              recording: RecordingTrials, blocks_and_steps: tuple, floors: RungFloors) -> ProbeResult | None:
    """The ladder with ReplayedTrials, then the chosen plan traced (recorded) where it was replayed: its breakdown,
    and the check of the replay at the answer (made from fewer blocks where the model repeats them). An answer made
    from fewer blocks stands as made: the made trial is the whole model's to the byte (the build included), which
    tests/search/test_block_extrapolation.py holds on every kind of model it has. None where it cannot stand (the
    model needs tensor values, or the replay was off at the answer): the caller then searches with every trial
    run."""
    twin = prior_device(device)
    trials = ReplayedTrials(device.budget_bytes, targets.batch)
    trials.blocks, trials.second.whole = blocks_and_steps[0], not blocks_and_steps[1]
    try:
        search = probe(model_file, twin, targets, headroom=headroom, steps=steps, objective=objective, amp=amp,
                       command="estimate", on_start=on_start, on_trial=on_trial, levers=levers, statics=statics,
                       trial=trials, floors=floors)
    except NeedsValues:
        return None
    finally:
        trials.close()  # (a copy tracing ahead what the search did not ask for)
    recording.breakdowns.update(trials.breakdowns)
    if search.config is None:
        return search
    plan = search.config.plan
    if plan in trials.blocks.refits:  # made from two traces: checked on three, as a replayed answer is
        trials.breakdowns.pop(plan, None)
    if plan not in trials.breakdowns:  # replayed (or made without a breakdown on its lines): traced as its check
        # and for its breakdown, from fewer blocks where the model repeats them (as exact: the tests hold the two
        # to the byte on every kind of model), else whole; its second step made where that was checked (and
        # its breakdown told from the first's records: made_peak.py), else both run
        made = trials.second.made
        trials.blocks.full = True  # (its own three traces lined up: none refitted from its rung's)
        result = trials.run_one(model_file, plan, twin, steps, LOCAL)
        if plan not in trials.breakdowns and trials.second.made > made:  # a made peak that could not be sorted
            trials.second.whole = True
            result = trials.run_one(model_file, plan, twin, steps, LOCAL)
        if plan not in trials.breakdowns:
            result, bd = recorded_trial(model_file, plan, twin, steps, LOCAL, run_trial)
            trials.breakdowns[plan] = bd
        if trials.breakdowns[plan] is None or result.peak_bytes != search.config.found_by.peak_bytes:
            return None
    recording.breakdowns[plan] = trials.breakdowns[plan]
    return search


@dataclass(frozen=True)
class WhatIf:
    """One plan the user asked about: its breakdown and, given a budget, whether it fits."""

    plan: Plan
    breakdown: MemoryBreakdown
    limit_bytes: int | None
    budget_bytes: int | None
    headroom: float
    levers: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # how it was measured, where not on fake tensors
    note: str | None = None  # about the card (no_bf16_note)
    optimizer: str | None = None  # its class's name where the model file has its own optimizer() (None: AdamW)
    card: str | None = None  # the card whose rules it was counted by ("Tesla T4", "a generic sm80 card")
    savings: tuple | None = None  # savings.Saving: what each lever takes off the peak (estimate --breakdown)

    @property
    def fits(self) -> bool | None:
        return None if self.limit_bytes is None else self.breakdown.peak_bytes <= self.limit_bytes

    def with_note(self, note: str | None) -> WhatIf:
        return replace(self, note=note)


def what_if(model_file: ModelFile, plan: Plan, device: FakeDevice, *, bounded: bool = True,
            headroom: float = HEADROOM, steps: int = TRIAL_STEPS) -> WhatIf:
    """The breakdown of one plan; where the device's budget is the user's (`bounded`), the verdict and levers too."""
    check_headroom(headroom)
    check_steps(steps)
    kernel_notes(), compile_notes()  # forget earlier trials' choices: this plan's are its own
    bd, computed = computing_where_needed(device, model_file.label, lambda: breakdown(model_file, plan, device, steps))
    computed += kernel_notes() + compile_notes() + batch_notes(model_file, device, plan.context_length)
    static = static_memory(model_file)
    if static.compiled:  # as the ladder says it (measurement_notes): traced as --compile traces
        computed += (own_compile_note(model_file.label, device.kind),)
    computed += declared_note(model_file)
    mislabelled = precision_note(model_file.label, plan.precision, static.weights_dtype, "--precision bf16-true")
    computed += (mislabelled,) if mislabelled else ()
    own = static.optimizer_name if model_file.has("optimizer") else None  # (its class: "SGD's state", as the ladder's)
    card = device.name.removesuffix(" (estimated)")
    if not bounded:  # no budget given: the breakdown alone (it lifts the device's budget anyway)
        return WhatIf(plan, bd, None, None, headroom, notes=computed, optimizer=own, card=card)
    limit = int(device.budget_bytes * (1 - headroom))
    lev: tuple[str, ...] = ()
    if bd.peak_bytes > limit:
        past = past_rungs(device, device.amp_dtype(), static, model_file.label,  # (why a lever cannot apply to
                          frozenset(LEVERS))  # this model: its own optimizer's class...)
        lev = tuple(levers_that_help(bd, static, limit, device.margin, headroom, plan, past))
    return WhatIf(plan, bd, limit, device.budget_bytes, headroom, lev, computed, optimizer=own, card=card)


def no_bf16_note(device: Device | None, precision: str | None) -> str | None:
    """bf16 asked for on a card without it: the memory is the same, the speed is not."""
    if device is None or precision not in ("bf16", "bf16-true") or device.supports_bf16():
        return None
    card = device.name.removesuffix(" (estimated)")
    return (f"{card} has no native bf16 (compute capability below 8.0): PyTorch emulates it, without fp16's "
            "tensor-core speed. The memory estimate holds; fp16 (--amp auto picks it there) is the card's mixed "
            "precision.")


def what_if_plan(model_file: ModelFile, micro_batch: int, context: int | None, precision: str | None,
                 checkpointing: bool | None, grad_accum: int | None, world_size: int = 1,
                 sharding: str | None = None, levers: str | None = None) -> Plan:
    """The one plan estimate's what-if options describe (fp32, no checkpointing, no accumulation unless given);
    `levers`: the levers past accumulation it uses (what_if_levers)."""
    targets = resolve_targets(model_file, None, context, None)
    precision, past = what_if_levers(levers, precision)
    plan = Plan(micro_batch, targets.context, precision or "fp32", bool(checkpointing),
                grad_accum if grad_accum is not None else 1,
                world_size=world_size, sharding=sharding or ("ddp" if world_size > 1 else "none"), **past)
    static = static_memory(model_file) if plan.activation_checkpointing else None
    if static is not None and static.checkpoints_itself:
        raise OomtuneError(f"{model_file.label}: --checkpointing, but build_model() turns the model's own activation "
                           f"checkpointing on ({static.checkpoints_itself}): every plan is checkpointed already "
                           "(leave out --checkpointing)")
    if static is not None and static.checkpointing_breaks:
        raise OomtuneError(f"{model_file.label}: --checkpointing, but it cannot train checkpointed "
                           f"({static.checkpointing_breaks})")
    if static is not None and static.checkpointing_idle:
        raise OomtuneError(f"{model_file.label}: --checkpointing, but its forward runs none of the "
                           f"{static.checkpointing_idle} it would wrap (define blocks(model))")
    if static is not None and not static.checkpointing_supported:
        raise OomtuneError(f"{model_file.label}: --checkpointing, but no blocks to wrap (define blocks(model))")
    return plan


def what_if_levers(levers: str | None, precision: str | None) -> tuple[str | None, dict[str, bool]]:
    """--levers with --micro-batch: (the plan's precision, bf16-true where named; the levers past accumulation it
    uses, as plan keys). The others are the plan's own options (--precision, --checkpointing, --grad-accum)."""
    if levers is None:
        return precision, {}
    names = parse_levers(levers)
    usual = sorted(n for n in names if n in ("amp", "checkpointing", "accumulation", "fsdp"))
    if usual:
        raise OomtuneError(f"--levers {levers!r} with --micro-batch names the levers past accumulation the plan "
                           f"uses; {', '.join(usual)} {'is' if len(usual) == 1 else 'are'} the plan's own "
                           "--precision, --checkpointing, --grad-accum, --sharding")
    if "bf16-true" in names and precision not in (None, "bf16-true"):
        raise OomtuneError(f"--levers bf16-true is a precision: it cannot go with --precision {precision}")
    keys = {PAST_LEVERS[n][0]: True for n in names if n in PAST_LEVERS}
    return ("bf16-true" if "bf16-true" in names else precision), keys | ({"compile": True} if COMPILE in names else {})
