"""`oomtune probe`: the ladder search (ladder.py) wired to trials on a device (trial.py), and the ProbeResult the
CLI renders: the rungs, every trial, the config, or why nothing fits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .. import __version__
from ..checkpointing import no_checkpointing_note
from ..config.schema import HEADROOM, TRIAL_STEPS, Config, FoundBy, Plan, TrialRecord
from ..dist.group import LOCAL, Dist, init
from ..dist.wrap import fsdp_unsupported
from ..errors import BAD_INPUT, OomtuneError
from ..hook_names import hook_name_notes
from ..levers.nf4_bnb import declared_note
from ..memory.breakdown import StaticMemory, static_memory
from ..memory.cards import GENERIC, find_gpu
from ..memory.compiled import compile_notes
from ..memory.cuda_attention import kernel_notes
from ..memory.devices import Device, TrackedDevice, make_device, resolve_kind
from ..memory.host_kernels import amp_cannot_run
from ..memory.margin import Margin, parse_margin
from ..model_file import ModelFile, own_compile_note
from ..units import format_bytes, utc_now
from .batch_notes import batch_notes
from .certify import CertifyingSearch
from .device_trials import DeviceTrials, prior_would_not_pay
from .headroom_note import OverHeadroom, admitting, over_headroom
from .ladder import LadderResult, LadderSearch, Objective, Point, Rung
from .leaks import LeakWatch
from .options import COMPILE, LEVERS, Targets, check_prior, check_search_options
from .past import PastRungs, past_rungs
from .prior import PriorReport, run_prior
from .rung_floors import RungFloors
from .rung_notes import checkpointing_saved_nothing
from .trial import TrialResult, computing_where_needed, kept_models, run_trial, settled_objects
from .weights_dtype import amp_adds_nothing, base_precision, weights_dtype_notes


def fsdp_reach(device: Device, world: int, sharding: str | None) -> tuple[int, str | None]:
    """(over how many ranks the weights can be sharded at best, why the ladder has no fsdp rung where it would
    add one: None when it has one, or when sharding was chosen)."""
    no_fsdp = fsdp_unsupported(device.torch_device.type) if world > 1 and sharding is None else None
    return (world if sharding == "fsdp" or (sharding is None and no_fsdp is None) else 1), no_fsdp


def no_fsdp_note(no_fsdp: str | None) -> str:
    return f" No fsdp rung was tried: {no_fsdp}." if no_fsdp is not None else ""


def ladder_rungs(device: Device, amp: str, checkpointing_supported: bool, world_size: int = 1,
                 sharding: str | None = None, levers: frozenset[str] = frozenset(LEVERS),
                 precision: str = "fp32") -> list[Rung]:
    """fp32 -> +amp -> +checkpointing (which keeps amp); on several ranks these replicate the model (ddp) and
    the ladder adds +fsdp (sharded weights, gradients and optimizer state; keeps amp and checkpointing) before
    accumulation is the only lever left. `sharding` puts every rung on that one instead. A lever not in `levers`
    is left out (the rungs past accumulation are past.py's). `precision`: what the rungs without amp train in
    (bf16-true for weights built in bf16, the first rung named so: weights_dtype.py)."""
    dtype = (device.amp_dtype() if amp == "auto" else amp) if "amp" in levers else precision
    base = sharding or ("ddp" if world_size > 1 else "none")
    rungs = [Rung(precision, precision, False, base)]
    if "amp" in levers:
        rungs.append(Rung("amp", dtype, False, base))
    ckpt = checkpointing_supported and "checkpointing" in levers
    if ckpt:
        rungs.append(Rung("checkpointing", dtype, True, base))
    if world_size > 1 and sharding is None and fsdp_unsupported(device.torch_device.type) is None \
            and "fsdp" in levers:
        rungs.append(Rung("fsdp", dtype, ckpt, "fsdp"))
    return rungs


@dataclass
class ProbeResult:
    ladder: LadderResult
    records: list[TrialRecord]
    static: StaticMemory
    targets: Targets
    limit_bytes: int
    config: Config | None  # None when nothing fits
    why_nothing_fits: str | None = None
    world_size: int = 1  # ranks; the ladder's micro-batches are per rank (targets.batch / world_size)
    budget_bytes: int | None = None  # what the search was given (limit_bytes is this less the headroom)
    notes: tuple[str, ...] = ()  # what the ladder left out, and why
    past: PastRungs | None = None  # the rungs past accumulation it could climb, and the levers it could not use
    prior: PriorReport | None = None  # the fake pre-estimate the rungs were certified from (None: none was tried)
    too_small: bool = False  # the budget is under the floor (estimate: bad input, exit 2, as probe's error is)
    over_headroom: OverHeadroom | None = None  # nothing fits, but a plan ran under the budget, over the limit

    @property
    def plan(self):
        """The plan found (None when nothing fits)."""
        return self.config.plan if self.config is not None else None

    @property
    def breakdown(self):
        """What the plan's peak is made of, where the search recorded it (an estimate's); None for a probe."""
        return self.config.found_by.breakdown if self.config is not None else None

    @property
    def trials_per_rung(self) -> dict[str, int]:
        return {r.rung.name: r.trials for r in self.ladder.rungs}


def plan_of(point: Point, world_size: int = 1) -> Plan:
    r = point.rung
    return Plan(micro_batch_size=point.micro_batch_size, context_length=point.context_length,
                precision=r.precision, activation_checkpointing=r.activation_checkpointing,
                grad_accum_steps=point.grad_accum_steps, world_size=world_size, sharding=r.sharding,
                optimizer_8bit=r.optimizer_8bit, nf4_frozen_weights=r.nf4_frozen_weights,
                offload_optimizer=r.offload_optimizer, offload_activations=r.offload_activations,
                chunked_loss=r.chunked_loss, optimizer_in_backward=r.optimizer_in_backward, compile=r.compile)


def why_nothing_fits(ladder: LadderResult, targets: Targets, static: StaticMemory, limit: int, world: int,
                     accumulation: bool = True) -> str:
    found = [r for r in ladder.rungs if r.found]
    if not found:
        results = {t.result for t in ladder.trials if t.point.micro_batch_size == 1} or \
            {t.result for t in ladder.trials}  # what micro-batch 1, which the reason names, did
        how = ("runs out of memory" if results <= {"oom"} else "goes over the limit (the budget less the headroom)"
               if "oom" not in results else "runs out of memory or goes over the limit")
        allow = "Allow a shorter --min-context, or use" if targets.min_context > 1 else "Use"  # a context of 1: none
        least = min(((t.measurement.peak_bytes, t.point.rung.name) for t in ladder.trials
                     if t.point.micro_batch_size == 1 and t.measurement.peak_bytes), default=None)
        took = f"; the least it took was {format_bytes(least[0])} ({least[1]})" if least else ""
        as_built = "" if static.levers else " (the model as built)"
        return (f"nothing fits in {format_bytes(limit)}: micro-batch 1 at context {targets.min_context} {how} on "
                f"every rung ({', '.join(r.rung.name for r in ladder.rungs)}){took}; {static.describe()}{as_built} "
                f"before activations. {allow} a larger --budget or a smaller model.")
    best = max(found, key=lambda r: (r.context_length, r.micro_batch_size))
    per_rank = targets.batch // world
    if not accumulation:
        why, add = (("the model steps its optimizer in backward", "") if static.steps_in_backward else
                    ("accumulation is not in --levers", "Add accumulation to --levers, or l"))
        return (f"nothing fits in {format_bytes(limit)} with the whole batch of {per_rank} per rank at once "
                f"({why}): at most micro-batch {best.micro_batch_size} fits ({best.rung.name}, context "
                f"{best.context_length}). {add or 'L'}ower --batch to {best.micro_batch_size * world}.")
    return (f"nothing fits in {format_bytes(limit)} with the global batch kept at {targets.batch}: micro-batch "
            f"{best.micro_batch_size} fits ({best.rung.name}, context {best.context_length}), but reaching "
            f"{per_rank} per rank needs gradient accumulation, which keeps every gradient "
            f"({format_bytes(static.gradients_bytes)}) alive through the next micro-step, and no accumulated plan "
            f"fits, not even 1 x {per_rank} at context {targets.min_context}. Lower --batch to "
            f"{best.micro_batch_size * world} (no accumulation)"
            + (", allow a shorter --min-context," if targets.min_context > 1 else "") + " or raise --budget.")


def check_static_fits(static: StaticMemory, device: Device, limit_bytes: int, headroom: float,
                      world_size: int = 1, past: PastRungs | None = None) -> None:
    """The floor fits the limit, else exit 2, saying which levers past accumulation `past` could not use (the
    user's --levers named them)."""
    floor = static.floor_bytes // world_size  # FSDP shards it across the ranks
    if floor > limit_bytes:
        unused = "; ".join(past.notes()) if past is not None else ""
        under = (f"; it is under the budget itself: --headroom {admitting(floor, device.budget_bytes):g} would leave "
                 "room for it, if not yet for the activations" if floor <= device.budget_bytes else "")
        raise OomtuneError(
            f"budget {format_bytes(device.budget_bytes)} ({format_bytes(limit_bytes)} after {headroom:.0%} "
            f"headroom) is too small for the weights alone: {static.describe()}"
            + (f", {format_bytes(floor)} per rank" if world_size > 1 else "")
            + (f" ({unused})" if unused else "") + under,
            BAD_INPUT,
        )


def probe(model_file: ModelFile, device: Device, targets: Targets, *, headroom: float = HEADROOM,
          steps: int = TRIAL_STEPS, objective: Objective = "fit", amp: str = "auto", command: str = "probe",
          on_start: Callable[[Point], None] | None = None,
          on_trial: Callable[[TrialRecord], None] | None = None, dist: Dist = LOCAL,
          sharding: str | None = None, levers: frozenset[str] = frozenset(LEVERS),
          statics: tuple[StaticMemory, StaticMemory] | None = None,
          trial: Callable[..., TrialResult] = run_trial, prior: bool | str | None = None,
          on_begin: Callable[[bool], None] | None = None, floors: RungFloors | None = None) -> ProbeResult:
    """Climb the ladder with real trials on `device`; every trial runs the training step itself.

    On several ranks (`dist`) every rank calls this: each trial runs on all of them, and they agree on its result
    (see run_trial), so every rank climbs the same ladder; the target batch is global (B / ranks per rank). The
    budget is the smallest of the ranks' (each GPU's own free memory), so they probe alike. `statics`: the model's
    static memory and floor (RungFloors.lowest), where the caller measured them already (estimate). `trial`: what
    runs one (run_trial's arguments and result; estimate's records each trial's breakdown as it runs); `floors`,
    the past rungs' floors known already (rung_floors.py).

    `prior`: on one process, on a device other than the fake one, run the same ladder on the fake device first and
    certify each rung from it (certify.py, prior.py): two device trials a rung where the prior is right. "auto":
    only where it pays (_prior). None: "auto" on cuda (a device trial costs GPU time, and on a shared card, OOMs),
    none on cpu (there fake trials cost more than the cpu trials they save, bench/RESULTS.md)."""
    check_search_options(headroom, steps, objective, amp)
    world = dist.world_size
    check_ranks_batch(targets, world)
    device.lower_budget(int(dist.min(device.budget_bytes)[0]))  # one process: its own
    limit = int(device.budget_bytes * (1 - headroom))
    static = statics[0] if statics else static_memory(model_file)
    sharded_by, no_fsdp = fsdp_reach(device, world, sharding)
    floors = floors or RungFloors(model_file, static)
    rungs, past, floor = all_rungs(model_file, device, amp, static, world, sharding, levers, limit, sharded_by,
                                   statics[1] if statics else None, floors=floors)
    check_static_fits(floor, device, limit, headroom, sharded_by, past if levers - {COMPILE} != set(LEVERS) else None)
    kernel_notes(), compile_notes()  # forget what trials before this probe chose (its own choose again)
    unreachable, notes = _first_notes(model_file, static, device, targets, amp, levers, rungs, limit, world)
    accumulates = "accumulation" in levers and not static.steps_in_backward  # (_first_notes says why not)
    check_prior(prior, device.kind, world > 1)
    auto = prior == "auto" or (prior is None and device.kind == "cuda" and world == 1)  # timed: does it pay?
    estimating = auto or bool(prior)
    if on_begin is not None:  # the input is good: the search begins (True: with the estimate on fake tensors)
        on_begin(estimating)
    # settled_objects: one full collection, then each trial's walks only what trials made; kept_models: reuse
    with settled_objects(), kept_models(device, trial is run_trial) as reuse:
        trials = DeviceTrials(lambda point: trial(model_file, plan_of(point, world), device, steps=steps, dist=dist,
                                             **reuse), world, on_start, on_trial, LeakWatch(model_file.label, limit))
        first = next((r for r in (*rungs, *past.rungs) if r.name not in unreachable), rungs[0])  # timed (auto)
        report = _prior(trials, model_file, device, Point(first, 1, targets.context), steps, targets.batch,
                        auto, lambda fake, trial: probe(
                            model_file, fake, targets, headroom=headroom, steps=steps, objective=objective, amp=amp,
                            command="estimate", levers=levers, statics=(static, floor), trial=trial, prior=False,
                            floors=floors), static.repeated_blocks,
                        ) if estimating else None
        ladder, computed = computing_where_needed(device, model_file.label, lambda: _climb(
            trials, limit, report, rungs, past, targets, world, objective, accumulates, unreachable,
            floors.for_ladder(tensor_budget(device, limit))))
    records, host = trials.records, trials.host
    climbed_past = len(ladder.rungs) > len(rungs)
    kernels = kernel_notes(ladder.choice.rung.precision if ladder.choice is not None else None)  # the plan's own
    kernels += compile_notes()
    notes += computed + kernels + (past.notes() + floors.note() if climbed_past or ladder.choice is None else ())
    notes += checkpointing_saved_nothing(model_file.label, rungs, ladder.trials, static, trial)
    notes += tuple(n for n in (trials.leaks.note(),) if n)
    if ladder.choice is None:
        return _nothing_fits(ladder, records, static, floor if climbed_past else static, targets, limit, world,
                             device, headroom, accumulates, no_fsdp, notes, past, report)
    c = ladder.choice
    chosen = Point(c.rung, c.micro_batch_size, c.context_length, c.grad_accum_steps)
    notes += batch_norm_note(model_file, static, c.micro_batch_size, c.grad_accum_steps * world)
    found = FoundBy(
        command=command, estimated=device.kind == "fake", device=device.kind, gpu_name=device.name,
        budget_bytes=device.budget_bytes, headroom=headroom, objective=objective,
        target_batch=targets.batch, target_context=targets.context, min_context=targets.min_context,
        peak_bytes=c.peak_bytes or 0, tokens_per_s=round(c.tokens_per_s, 1) if c.tokens_per_s else None,
        torch_version=str(torch.__version__), cuda_version=torch.version.cuda, oomtune_version=__version__,
        date=utc_now(), trials=tuple(records), notes=notes, host_peak_bytes=host.get(chosen) or None,
        card=device.card.aliases[0] if device.card is not None else None,
        prior=report.summary() if report is not None else None, margin=flat_margin(device),
        checkpointing_via=static.checkpointing_via if c.rung.activation_checkpointing else None)
    config = Config(model=model_file.section or str(model_file.path), plan=plan_of(chosen, world), found_by=found)
    return ProbeResult(ladder, records, static, targets, limit, config, world_size=world, notes=notes,
                       budget_bytes=device.budget_bytes, past=past, prior=report)


def _nothing_fits(ladder: LadderResult, records: list, static: StaticMemory, floor: StaticMemory, targets: Targets,
                  limit: int, world: int, device: Device, headroom: float, accumulates: bool, no_fsdp: str | None,
                  notes: tuple, past: PastRungs, report: PriorReport | None) -> ProbeResult:
    """The probe's result where no plan fits: why (`floor`: the one the reason names), with the plans refused only
    for the headroom."""
    refused = over_headroom(((plan_of(t.point, world).describe(with_global=False), t.measurement.peak_bytes)
                             for t in ladder.trials if t.result == "over-headroom"), device.budget_bytes, headroom)
    why = why_nothing_fits(ladder, targets, floor, limit, world, accumulates) + \
        (f" {refused.text()}." if refused else "") + no_fsdp_note(no_fsdp)
    return ProbeResult(ladder, records, static, targets, limit, None, why, world, device.budget_bytes, notes,
                       past=past, prior=report, over_headroom=refused)


def tensor_budget(device: Device, limit: int) -> int:
    """What the limit leaves tensors (on cuda the budget is the caching allocator's: less its margin)."""
    return device.tensor_budget(limit) if isinstance(device, TrackedDevice) else limit


def _first_notes(model_file: ModelFile, static: StaticMemory, device: Device, targets: Targets, amp: str,
                 levers: frozenset[str], rungs: list[Rung], limit: int, world: int) -> tuple[frozenset[str], tuple]:
    """The rungs out of reach (out_of_reach) and the notes known before any trial."""
    notes = measurement_notes(model_file, static, device, targets.min_context, amp)
    unreachable, note = out_of_reach(rungs, static, tensor_budget(device, limit), world, model_file.label)
    unrunnable = amp_cannot_run(static.lstm, device, amp)
    notes += note + ((f"{model_file.label} {unrunnable}",) if unrunnable and "amp" in levers else ())
    if static.steps_in_backward and "accumulation" in levers:
        notes += (f"no accumulation rung: {static.steps_in_backward} of {model_file.label}'s trained parameters have "
                  "post-accumulate-grad hooks (an optimizer stepped in backward updates them at every micro-batch's "
                  "backward, so accumulating micro-batches would change the training)",)
    return unreachable, notes


def _prior(trials: DeviceTrials, model_file: ModelFile, device: Device, first: Point, steps: int, batch: int,
           auto: bool, ladder: Callable, repeats: tuple | None) -> PriorReport:
    """The prior's report: run (`ladder` on the fake device; `repeats`: the model's repeated blocks), or, "auto",
    skipped where timing the `first` trial (one the search runs anyway, kept for it) on both says it would not
    pay."""
    why_not = prior_would_not_pay(trials, model_file, device, first, plan_of(first, 1), steps, batch) if auto else None
    return PriorReport(missing=why_not) if why_not else run_prior(ladder, device, model_file.label, repeats)


def flat_margin(device: Device) -> str | None:
    """The flat margin (--margin) a simulated device accounted by where `check` and `train` would not take it
    by themselves: beside a card (whose own margin is their default), or on fake tensors."""
    margin = getattr(device, "margin", None)
    if isinstance(margin, Margin) and (device.card is not None or device.kind == "fake"):
        return margin.describe()
    return None


def _climb(trials: DeviceTrials, limit: int, report: PriorReport | None, rungs: list[Rung], past: PastRungs,
           targets: Targets, world: int, objective: Objective, accumulation: bool,
           unreachable: frozenset[str] = frozenset(), reaches: Callable[[Rung], bool] | None = None
           ) -> LadderResult:
    """The search on the device: certified from the prior's rungs where there is one (the rungs it could not
    certify go into report.fell_back), else the ladder's own; the `unreachable` rungs are not tried (out_of_reach),
    nor those past accumulation that `reaches` says cannot fit (RungFloors). Run afresh (records cleared) where it
    reruns on computed tensors."""
    trials.records.clear()
    search = (CertifyingSearch(trials.measure, limit, report.priors, on_trial=trials.collect)
              if report and report.priors else LadderSearch(trials.measure, limit, on_trial=trials.collect))
    search.out_of_reach = unreachable
    if reaches is not None:
        search.reaches = reaches
    ladder = search.run(rungs, targets.batch // world, targets.context, targets.min_context, objective,
                        past=past.rungs, accumulation=accumulation)
    if isinstance(search, CertifyingSearch):
        report.fell_back = tuple(search.fell_back)
    return ladder


def out_of_reach(rungs: list[Rung], static: StaticMemory, tensor_budget: int, world: int,
                 label: str) -> tuple[frozenset[str], tuple[str, ...]]:
    """The usual rungs (fp32, amp, checkpointing, fsdp) none of whose plans can fit, and the note that says so:
    the floor, which none of them changes (the weights, gradients and optimizer state and the optimizer step's
    temporaries; sharded on an fsdp rung), is past the tensor budget, so each of their trials would run out of
    memory. The ladder climbs past them without trials."""
    names = [r.name for r in rungs
             if static.floor_bytes // (world if r.sharding == "fsdp" else 1) > tensor_budget]
    if not names:
        return frozenset(), ()
    return frozenset(names), (f"{label}: not tried on the {', '.join(names)} rung{'s' if len(names) > 1 else ''}: "
                              f"{static.describe()}, more than the {format_bytes(tensor_budget)} the budget leaves "
                              "tensors, whatever the batch",)


def all_rungs(model_file: ModelFile, device: Device, amp: str, static: StaticMemory, world: int,
              sharding: str | None, levers: frozenset[str], limit: int, sharded_by: int,
              floor: StaticMemory | None = None, *, floors: RungFloors) -> tuple[list[Rung], PastRungs, StaticMemory]:
    """The usual rungs, those past accumulation, and the floor the budget is checked against (`floor`: measured
    already; `floors`: where the past rungs' are kept)."""
    if amp_adds_nothing(static, amp):  # 16-bit weights: autocast would only copy them (weights_dtype.py)
        levers = levers - {"amp"}
    if amp_cannot_run(static.lstm, device, amp):  # (host_kernels.py)
        levers = levers - {"amp"}
    rungs = ladder_rungs(device, amp, static.checkpointing_supported, world, sharding, levers,
                         base_precision(static))
    past = past_rungs(device, rungs[-1].precision, static, model_file.label, levers, world)
    if COMPILE in levers:  # every rung compiled
        rungs = [replace(r, compile=True) for r in rungs]
        past.rungs = [replace(r, compile=True) for r in past.rungs]
    return rungs, past, floor or floors.lowest(past, limit, sharded_by)


def measurement_notes(model_file: ModelFile, static: StaticMemory, device: Device,
                      context: int, amp: str = "auto") -> tuple[str, ...]:
    """What the ladder leaves out and how its memory is measured, where either is not what the user would assume;
    what make_batch() shows of its batches (batch_notes); what a plan trains for weights built in 16 bits."""
    notes = (() if static.checkpointing_supported
             else (no_checkpointing_note(model_file.label, static.checkpoints_itself,
                                         static.checkpointing_breaks, static.checkpointing_idle),))
    notes += batch_notes(model_file, device, context) + hook_name_notes(model_file.label, model_file.module)
    if static.compiled and device.kind != "cuda":
        notes += (own_compile_note(model_file.label, device.kind),)
    notes += declared_note(model_file) + weights_dtype_notes(model_file.label, static, amp_adds_nothing(static, amp))
    if static.layer_drop is not None:
        notes += (static.layer_drop,)
    return notes


def batch_norm_note(model_file: ModelFile, static: StaticMemory, micro_batch: int, pieces: int) -> tuple[str, ...]:
    """Accumulation and ranks (`pieces` micro-batches a step) make the global batch's gradient, but not BatchNorm's."""
    if not static.batch_norm or pieces == 1:
        return ()
    return (f"{model_file.label} has BatchNorm layers: with accumulation or ranks each normalises over its "
            f"micro-batch of {micro_batch}, not the global batch of {micro_batch * pieces}, so training is not that "
            "of one batch "
            "(noisier statistics; at micro-batch 1, none across examples): GroupNorm or LayerNorm do not depend on "
            "the batch",)


def check_ranks_batch(targets: Targets, world_size: int) -> None:
    if targets.batch % world_size:
        raise OomtuneError(f"--batch {targets.batch} is not a multiple of the {world_size} ranks: the global batch is "
                           "shared out evenly")


def probe_on_ranks(kind: str, budget: str | None, dist_timeout: float, launched: bool,
                   gpu: str | None = None, margin: str | None = None) -> tuple[Device, Dist]:
    """The device a probe runs on (with `gpu`, a simulated one accounting like that card; `margin`, a simulated
    one's rule for what a GPU needs beyond tensors), and its ranks: a worker torchrun started joins the others (on
    cuda this picks its own GPU, before the device is made); one process has LOCAL."""
    kind = resolve_kind(kind)
    if margin is not None and kind == "cuda":
        raise OomtuneError("--margin is for the simulated devices (--device cpu or fake): on cuda what a GPU needs "
                           "beyond tensors is measured", BAD_INPUT)
    card = find_gpu(gpu) if gpu else (GENERIC if kind == "fake" else None)  # fake stands in for a card: estimate's
    rule = parse_margin(margin) if margin is not None else None
    dist = init(kind, "ddp", dist_timeout) if launched else LOCAL
    return make_device(kind, budget, card, rule), dist
