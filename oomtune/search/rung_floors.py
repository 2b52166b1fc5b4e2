"""The floor of each rung past accumulation: what the weights, gradients, optimizer state and the optimizer step's
scratch take with the rung's levers applied (memory/breakdown.static_memory with its plan at micro-batch 1),
measured on fake tensors once per rung, as the ladder reaches it. Where that floor is past the memory the budget
leaves tensors, no plan of the rung can fit, whatever its batch: the ladder passes it without trials, as it passes
the usual rungs whose floor does not fit (probe.out_of_reach). Measuring a floor costs one build and one optimizer
step of the model, with no forward or backward (in an estimate, of the model with 2, 3 and 4 of its repeated blocks
where it repeats 12 or more: extrapolate.extrapolated_static); trying a rung costs two or three whole training steps
(a 7B LoRA estimate's chunked-loss rung kept its frozen weights in fp32, 27.6 GB on a 24 GB card, and ran three
trials to find micro-batch 1 out of memory)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from ..config.schema import Plan
from ..memory.breakdown import StaticMemory, static_memory
from ..model_file import ModelFile
from ..units import format_bytes
from .extrapolate import KEPT, BlockTrials, extrapolated_static
from .ladder import Rung
from .past import PastRungs


def floor_plan(rung: Rung) -> Plan:
    """The plan whose floor is the rung's: micro-batch 1 at context 1 (the floor does not depend on them)."""
    from .ladder import Point
    from .probe import plan_of  # (probe imports this module)

    return plan_of(Point(rung, 1, 1))


class RungFloors:
    """The rungs' floors, each measured once (`floor`), and the rungs passed because theirs does not fit the tensor
    budget (`reaches`, `note`). Shared by the estimate's floor check (`lowest`), its ladder, and the prior's
    ladder and the device's in a probe, so that no floor is measured twice. `static`: the model's own (no levers),
    whose weights alone bound the floor of a rung that leaves them as built (not NF4; cast to bf16 for bf16-true):
    where they are past the budget, that rung is passed with no floor measured."""

    def __init__(self, model_file: ModelFile, static: StaticMemory, blocks: BlockTrials | None = None):
        self.model_file = model_file
        self.static = static
        self.blocks = blocks
        self.floors: dict[Plan, StaticMemory] = {}
        self.passed: dict[str, tuple[str, int]] = {}  # rung name -> (what its floor holds, the budget it is past)
        self.extrapolated: set[Plan] = set()  # the plans whose floors were made from fewer blocks
        self.passed_made = False  # a floor of a rung passed was made so

    def floor(self, rung: Rung) -> StaticMemory:
        plan = floor_plan(rung)
        if plan not in self.floors:
            self.floors[plan] = (self._from_blocks(plan, rung.name)
                                 or static_memory(self.model_file, plan, rung.name, checks=False))
        return self.floors[plan]

    def _from_blocks(self, plan: Plan, levers: str) -> StaticMemory | None:
        """The floor from the model with 2, 3 and 4 of its repeated blocks (each count on its line to the whole
        model's: extrapolate.extrapolated_static), where `blocks` (the estimate's BlockTrials) cuts the model; else
        None, and it is measured whole."""
        if self.blocks is None:
            return None
        statics = []
        measure = [functools.partial(self.blocks.measured, self.model_file, keep,
                                     lambda fewer: static_memory(fewer, plan, levers, checks=False))
                   for keep in (KEPT, KEPT + 1, KEPT + 2)]
        with self.blocks.fanned(measure) as three:  # (side by side where they can: fan_out.py)
            for i in range(3):
                ok, static = three.result(i)
                if not ok:
                    return None
                statics.append(static)
        made = extrapolated_static(statics, self.blocks.blocks)
        if made is not None:
            self.extrapolated.add(plan)
        return made

    def lowest(self, past: PastRungs, limit: int, sharded_by: int) -> StaticMemory:
        """The floor the budget is checked against: the model's own, or, where that does not fit and the ladder has
        rungs past accumulation, the lowest with their levers: the chain's last rung's or the one beside it's (no
        gradients held; not measured where the weights it keeps as built are more than the former)."""
        static = self.static
        if static.floor_bytes // sharded_by <= limit or not past.rungs:
            return static
        lowest: list[StaticMemory] = []
        for r in [*[r for r in past.rungs if not r.optimizer_in_backward][-1:],
                  *[r for r in past.rungs if r.optimizer_in_backward]]:
            if not lowest or self.at_least(r) < min(s.floor_bytes for s in lowest):
                lowest.append(self.floor(r))
        return min(lowest, key=lambda s: s.floor_bytes) if lowest else static

    def at_least(self, rung: Rung) -> int:
        """A bound under the rung's floor, known without measuring it: the weights as built, for a rung that
        leaves them so; cast to bf16 (StaticMemory.bf16_weights_bytes) for bf16-true; 0 for NF4, and for the
        bf16-true rungs of a model that declares 4-bit weights (the build keeps them in 4 bits: every weight cast to
        bf16 is no bound; its weights as built, quantized as on every rung, still bound the others)."""
        if rung.nf4_frozen_weights or (self.static.declared_4bit and rung.precision == "bf16-true"):
            return 0
        return self.static.bf16_weights_bytes if rung.precision == "bf16-true" else self.static.weights_bytes

    def for_ladder(self, tensor_budget: int) -> Callable[[Rung], bool]:
        """`reaches` at `tensor_budget` for one ladder's climb (LadderSearch.reaches): the rungs passed are that
        climb's (the prior's fake ladder, whose twin's budget differs, passes its own)."""
        self.passed.clear()
        self.passed_made = False
        return lambda rung: self.reaches(rung, tensor_budget)

    def reaches(self, rung: Rung, tensor_budget: int) -> bool:
        """Can some plan of `rung` fit? False where its floor alone is past `tensor_budget` (what the limit leaves
        tensors)."""
        if self.at_least(rung) > tensor_budget:
            what = "weights in bf16" if rung.precision == "bf16-true" else "weights"
            self.passed[rung.name] = f"{what} {format_bytes(self.at_least(rung))} alone", tensor_budget
            return False
        floor = self.floor(rung)
        if floor.floor_bytes <= tensor_budget:
            return True
        self.passed[rung.name] = floor.describe(), tensor_budget
        self.passed_made |= floor_plan(rung) in self.extrapolated
        return False

    def note(self) -> tuple[str, ...]:
        """The note naming the rungs passed without trials, each with its floor."""
        if not self.passed:
            return ()
        names = ", ".join(self.passed)
        groups: dict[str, list[str]] = {}  # what the floor holds -> the rungs it is said for
        for name, (floor, _) in self.passed.items():
            groups.setdefault(floor, []).append(name)
        floors = "; ".join(floor if len(groups) == 1 else f"{', '.join(rungs)}: {floor}"
                           for floor, rungs in groups.items())
        budget = min(b for _, b in self.passed.values())
        made = (f" (floors measured with {KEPT}, {KEPT + 1} and {KEPT + 2} of its {self.blocks.blocks} repeated "
                "blocks, each figure on its line to all of them; the optimizer step's scratch left out)"
                if self.passed_made else "")
        return (f"{self.model_file.label}: not tried on the {names} rung{'s' if len(self.passed) > 1 else ''} past "
                f"accumulation: {floors}, more than the {format_bytes(budget)} the budget leaves tensors, whatever "
                f"the batch{made}",)
