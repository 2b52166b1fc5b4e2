"""The estimate's traced trials with their second step made from the first (memory/second_step.py): where a card's
allocator model reads the peak, a trial runs two training steps (the second starts from where the first left the
allocator's blocks); on fake tensors the second costs as much Python as the first and repeats it. The first trial of
each plan's levers (at any micro-batch, context or accumulation, with or without checkpointing; of the whole model, and
apart from it of the models with fewer of its blocks) runs both and checks that the step made from the first is the one
run, event for event; where it is, later trials with those levers run one step and make the second, and their figures
come from replaying the two (the tracker's count and the allocator model, as a replay from two sizes does). Where it is
not, every trial with those levers runs both.

A trial with a made step has the breakdown of its made peak where it was recorded (memory/made_peak.py: each life of the
made step has the kind of the first step's life it repeats); where that cannot be told it has none, and the estimate's
answer, whose breakdown it shows, is traced again with both steps run (`whole`)."""

from __future__ import annotations

import dataclasses

from ..config.schema import Plan
from ..memory.breakdown import kind_of
from ..memory.life_kinds import peak_parts
from ..memory.made_peak import made_kinds
from ..memory.reading import Reading
from ..memory.replay import Trace
from ..memory.second_step import second_step_agrees, with_second_step

TWO_STEPS = 2  # the trial's steps this applies to (TRIAL_STEPS): a first, and a second made from it


class SecondSteps:
    """Per plan's levers (_key), apart for the whole model and for models made with fewer of its blocks: None until
    a trial checked them, then whether the made step was the run one. A check on fewer blocks does not hold for the
    whole model: a later block can keep what its first forward made (a local-attention layer's mask), which the
    first blocks never show (tests/search/test_second_steps.py); among the fewer-block models, the traces of 2, 3
    and 4 blocks must line up (repeats.py), which such a block breaks."""

    def __init__(self):
        self.agreed: dict[tuple[Plan, bool], bool] = {}
        self.whole = False  # run every step (estimate(made_steps=False); an answer whose made peak had no breakdown)
        self.made = 0  # trials whose second step was made
        self._base = 0  # self.made at mark()

    def mark(self) -> None:
        """Before trials run side by side in copies of this process (fan_out.py): what they add is counted from
        here."""
        self._base = self.made

    def handed(self) -> tuple:
        """(In a copy) what its trials found: the verdicts, the made steps since mark()."""
        return dict(self.agreed), self.made - self._base

    def take(self, state: tuple) -> None:
        """A copy's findings kept here: a check that failed there stands here too."""
        agreed, made = state
        for key, verdict in agreed.items():
            self.agreed[key] = self.agreed.get(key, True) and verdict
        self.made += made

    def mode(self, plan: Plan, device, steps: int, world_size: int, fewer: bool = False) -> str | None:
        """"check" (run both, compare), "make" (run one, make the second) or None (run them all, as asked);
        `fewer`: the trial's model has fewer of its blocks (FewerBlocks)."""
        if (self.whole or steps != TWO_STEPS or world_size != 1
                or not (getattr(device, "traces", False) and getattr(device, "never_runs_out", False))
                or device.computes or device.primes):
            return None
        agreed = self.agreed.get((levers_key(plan), fewer))
        return "check" if agreed is None else ("make" if agreed else None)

    def finish(self, plan: Plan, reading: Reading, device, mode: str, fewer: bool = False) -> Reading:
        """The trial's reading: as run ("check": after comparing its second step with the one made from its
        first), or made ("make": the two steps' replay)."""
        initial, host_initial = device.traced_from
        if reading.events is None or not reading.points:
            if mode == "make":  # (mode() asks for a traced device: a made step with no events would be one step's)
                raise AssertionError("a trial whose second step is made was not traced")
            return reading
        if mode == "check":
            self.agreed[levers_key(plan), fewer] = second_step_agrees(reading.events, initial, host_initial,
                                                                reading.points, reading.loss_key)
            return reading
        keys = {k for k, _ in (*initial, *host_initial)}
        made_events = with_second_step(reading.events, keys, reading.points, reading.loss_key)
        trace = Trace.of(initial, made_events, host_initial)
        from .extrapolate import as_lines  # (extrapolate imports trial, which imports this)

        made = device.replay(as_lines(trace), plan.micro_batch_size)
        if made is None:
            raise AssertionError("a made second step replays on its own lines")
        self.made += 1
        recorder = device.tracker.recorder
        if recorder is not None:  # a breakdown is read: what was live at the made peak, by the first step's records
            recorder.kinds = made_kinds(recorder.records, initial, made_events, len(reading.events), reading.points,
                                        lambda r: kind_of(recorder, r))
            recorder.made = peak_parts(trace, recorder.kinds) if recorder.kinds is not None else None
        return dataclasses.replace(made, trace=trace)


def levers_key(plan: Plan) -> Plan:
    """What a check holds for: the plan's levers, at any micro-batch, context and accumulation (the steps' sizes and
    their micro-steps' count do not change which storages outlive a step), with or without checkpointing and
    activation offloading (they change when a step's activations live, not what outlives it: a sweep of 19 model
    files x 4 precisions x both, checked without them, made every second step as run, breakdowns included)."""
    return dataclasses.replace(plan, micro_batch_size=1, context_length=1, grad_accum_steps=1, global_batch_size=0,
                               activation_checkpointing=False, offload_activations=False)
