"""A trial of a model of N repeated blocks from trials of k, k+1 and k+2 of them (fewer_blocks.py): their traces make
the trace at N (memory/repeats.py), whose replay gives the trial's peaks to the byte, in a fraction of the time (a
7B Llama's 32 layers: 9 layers traced). Used by the estimate's trials on the never-out twin (ReplayingTrials), which
trace, and for its rungs' floors (extrapolated_static, rung_floors.py); wherever a check fails it answers None and
the trial (or floor) runs whole. The k+1 and k+2 traces run side by side where the machine has the cores, k+1 in a
forked copy of the process (BlockTrials.fanned, fan_out.py)."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import Counter
from collections.abc import Callable

from ..config.schema import MemoryBreakdown, Plan
from ..memory.breakdown import StaticMemory, breakdown_of
from ..memory.devices import FakeDevice
from ..memory.life_kinds import peak_parts
from ..memory.repeats import Template
from ..memory.replay import Lines, Trace
from . import fan_out
from .fewer_blocks import FewerBlocks, Stacks
from .second_steps import levers_key
from .trial import TrialResult

KEPT = 2  # blocks in the first of the three traced trials (its runs' first and last periods may differ)
MIN_BLOCKS = 12  # fewer repeated blocks than this: tracing 2 + 3 + 4 of them saves too little to try (GPT-2 small's
# 12, on 2 cores: its ladder 25-30% faster, and 10-20% in one process)


def as_lines(trace: Trace) -> Lines:
    """A trace as lines that do not change with the micro-batch (what replay() takes)."""
    events = tuple((e[0], e[1], e[2], 0) if e[0] in ("set", "hset") else e for e in trace.events)
    return Lines(trace.initial, events, (1, 1), trace.host_initial)


def _line(values: list[int], at: int) -> int | None:
    """The value at `at` blocks on the line through values at KEPT, KEPT+1, ...; None where they are not on one."""
    step = values[1] - values[0]
    if any(b - a != step for a, b in zip(values, values[1:], strict=False)):
        return None
    return values[0] + step * (at - KEPT)


# what the caching allocator model reserves is not a line in the blocks (its segments fill unevenly): taken from the
# made trace's replay instead, with the margin over the tensor peak and the peak it makes
RESERVED = ("modelled_reserved_bytes", "margin_bytes", "peak_bytes")


def extrapolated_breakdown(breakdowns: list[MemoryBreakdown], blocks: int,
                           reserved: tuple[int, object] | None = None) -> MemoryBreakdown | None:
    """The breakdown at `blocks` from those at KEPT, KEPT+1, ...: each byte count on its line, the peak in the same
    phase; None where a count is off its line or the phase moved. `reserved`: (the allocator model's reserved peak
    replayed on the made trace, the device's margin): the reserved bytes, the margin and the peak then come from
    it, not from lines."""
    first = breakdowns[0]
    if any(bd.phase != first.phase or bd.margin != first.margin for bd in breakdowns):
        return None
    fields = {}
    for f in dataclasses.fields(MemoryBreakdown):
        values = [getattr(bd, f.name) for bd in breakdowns]
        if f.name in ("phase", "margin", "step_peak_bytes") or all(v is None for v in values) or \
                (reserved is not None and f.name in RESERVED):
            continue
        if any(v is None for v in values):
            return None
        fields[f.name] = _line(values, blocks)
        if fields[f.name] is None:
            return None
    fields["step_peak_bytes"] = None  # (not a line: BlockTrials._made reads it off the made trace)
    if reserved is not None:
        bytes_, margin = reserved
        fields.update(modelled_reserved_bytes=bytes_, peak_bytes=0,  # (0: tensor peak + margin)
                      margin_bytes=margin.overhead(fields["tensor_peak_bytes"], bytes_))
    return dataclasses.replace(first, **fields)


class BlockTrials:
    """The estimate's trials by their blocks: `trial` answers a plan's trial from three fewer-block trials, or None
    (the model repeats too few blocks, the traces do not line up, a figure is off its line: it then runs whole)."""

    def __init__(self, min_blocks: int = MIN_BLOCKS):
        self.min_blocks = min_blocks
        self.blocks: int | None = None  # the model's repeated blocks, once seen (0: none)
        self.seen = None  # what the first build found (fewer_blocks.Stacks): later builds cut as they are made
        self.off: set[Plan] = set()  # rungs (plans at micro-batch 1) where the three did not line up
        self.fourth = False  # a trial's traces lined up only with a fourth
        self.levers: set[Plan] = set()  # the levers (levers_key) of the trials traced so far
        self.fitted: dict[Plan, list] = {}  # a rung's (its plan at micro-batch 1) templates fitted on three traces
        # or more, each with its traced trials ((result, breakdown) pairs), the latest first
        self.full = False  # every trial fitted on three traces (the estimate's check at its answer), none refitted
        self.refits: set[Plan] = set()  # plans made from two traces and their rung's template (Template.refit): the
        # estimate's answer among them is checked on three

    def knowing(self, repeats: tuple | None) -> BlockTrials:
        """Told what the whole model's build found (StaticMemory.repeated_blocks): no fewer-block build then builds
        the whole model first to find them."""
        self.seen = Stacks(*repeats) if repeats else None
        self.blocks = self.seen.length - self.seen.start if self.seen else 0
        return self

    def measured(self, model_file, keep: int, measure: Callable) -> tuple[bool, object]:
        """(True, measure(the model file at `keep` blocks)), or (False, None) where the model repeats fewer than
        min_blocks blocks (known once a build has seen them) or cannot be cut, or the measurement raised (a model
        that cannot run with fewer blocks: the caller measures it whole, and raises there what is the user's)."""
        if self.blocks is not None and self.blocks < self.min_blocks:
            return False, None
        fewer = FewerBlocks(model_file, keep, self.seen)
        try:
            out = measure(fewer)
        except Exception:  # noqa: BLE001
            if fewer.seen is not None and not fewer.seen.cut:  # its blocks are copied: never again
                self.blocks = 0
            return False, None
        if self.blocks is None:
            self.blocks, self.seen = fewer.repeated or 0, fewer.seen
        return self.blocks >= self.min_blocks, out

    def fanned(self, tasks: list[Callable], carried: tuple = (), warm: bool = False) -> fan_out.Fanned:
        """The tasks (each a `measured`): the first here, the others side by side in copies of this process once it
        has found the model's blocks enough to cut (fan_out.py); `warm`: the first in a copy too (trials with the
        same levers ran before, here or in copies forked after them: what a first trial fills, the SecondSteps
        verdict and the first-of-their-kind calls, is filled). What the copies' tasks changed here that matters
        later is handed back: a model whose blocks cannot be cut, and `carried`'s states."""
        def handed():
            return self.blocks, self.seen.cut if self.seen is not None else None, [c.handed() for c in carried]

        def take(state):
            blocks, cut, states = state
            self.blocks = 0 if blocks == 0 else self.blocks
            if cut is False and self.seen is not None:
                self.seen.cut = False
            for c, s in zip(carried, states, strict=True):
                c.take(s)

        def ready() -> bool:  # (the copies' counts start here)
            for c in carried:
                c.mark()
            return bool(self.blocks) and self.blocks >= self.min_blocks

        return fan_out.Fanned(tasks, handed, take, ready, warm=warm)

    def trial(self, model_file, plan: Plan, device: FakeDevice, run: Callable,
              carried: tuple = ()) -> tuple[TrialResult, object] | None:
        """`run(model_file, plan) -> (TrialResult, breakdown or None)` on the three fewer-block model files; the
        trial at all the blocks and its breakdown (None where a breakdown did not line up), or None. The three run
        side by side where they can (fanned); `carried`: what `run` changes that later trials depend on (each with
        `handed()` and `take(state)`: SecondSteps' verdicts)."""
        key = dataclasses.replace(plan, micro_batch_size=1, global_batch_size=0)
        if key in self.off:
            return None
        start = time.perf_counter()
        runs: list = []
        template = None
        measure = [functools.partial(self.measured, model_file, keep, lambda fewer: run(fewer, plan))
                   for keep in (KEPT, KEPT + 1, KEPT + 2, KEPT + 3)]  # a fourth only where three do not line up
        fitted = [] if self.full else self.fitted.get(key, [])  # (other micro-batches of the rung, on three)
        ahead = 2 if fitted else 4 if self.fourth else 3  # (side by side: once a trial needed a fourth)
        warm = levers_key(plan) in self.levers  # (a first trial with them filled what the later ones read)
        with self.fanned(measure[:ahead], carried, warm) as fanned:
            for i in range(4):
                ok, out = fanned.result(i) if i < ahead else measure[i]()
                if not ok:
                    self.off.add(key)
                    return None
                result, bd = out
                if result.oom or result.trace is None:
                    self.off.add(key)
                    return None
                runs.append((result, bd))
                self.levers.add(levers_key(plan))
                template, kinds_of = self._fit(key, runs, fitted)
                if template is not None:
                    break
        made = self._made(plan, device, runs, template, kinds_of) if template is not None else None
        if made is None:
            self.off.add(key)
            return None
        result, bd = made
        if len(runs) == 2:
            self.refits.add(plan)
        return dataclasses.replace(result, seconds=time.perf_counter() - start,
                                   build_seconds=sum(r.build_seconds for r, _ in runs)), bd

    def _fit(self, key: Plan, runs: list, fitted: list) -> tuple[Template | None, list]:
        """(the template of the trials traced so far, the trials whose lives' parts its breakdown may read): on
        the first two, a template of the rung fitted on three (`fitted`) refitted where that makes them (not where
        micro-batch 1 took another path: a size-1 dim that is a view there and a copy at 2); else fitted on three
        or more (kept as the rung's); else (None, []): trace another."""
        traces = [r.trace for r, _ in runs]
        if fitted and len(runs) == 2:
            for template, traced in fitted:
                refitted = template.refit(traces)
                if refitted is not None and refitted.at(self.blocks) is not None:  # (else a third trace, not `off`)
                    return refitted, traced
            return None, []
        template = Template.fit(traces, KEPT) if len(runs) >= 3 else None
        if template is not None:
            self.fourth |= len(runs) > 3
            self.fitted.setdefault(key, []).insert(0, (template, list(runs)))
        return template, []

    def _made(self, plan: Plan, device: FakeDevice, runs: list, template: Template, kinds_of: list) -> tuple | None:
        trace = template.at(self.blocks)
        reading = device.replay(as_lines(trace), plan.micro_batch_size) if trace is not None else None
        # the host's peak is the made trace's, as the device's: counted on the three traced, it must read theirs (a
        # line through theirs would not hold where that peak moves with the blocks, as a QLoRA's bf16-true build's)
        if reading is None or any(r.trace.host_peak() != r.host_peak_bytes for r, _ in runs):
            return None
        result = TrialResult.from_reading(plan, reading, trace=trace, extrapolated=True)
        return result, _made_breakdown(template, self.blocks, runs, result, device, kinds_of)


def _made_kinds(template: Template, blocks: int, runs: list):
    kinds = [r.kinds for r, _ in runs]
    return template.kinds_at(blocks, [r.trace for r, _ in runs], kinds) if all(k is not None for k in kinds) else None


def _made_breakdown(template: Template, blocks: int, runs: list, result: TrialResult, device: FakeDevice,
                    kinds_of: list = ()):
    """The breakdown of the made trial's peak: its lives' parts from those of the three traced (life_kinds.py),
    wherever its peak falls; else each figure on its line through theirs, where the peak stays in one place (the
    two must give the made trace's peak); else None. Refitted on two traces (`kinds_of`: the rung's trials its
    template was fitted on), the parts are theirs where the two do not tell every slot's (a run's period between
    its first and last is seen from 4 blocks on), and never lines (through two points, nothing checks them)."""
    made = _made_kinds(template, blocks, runs) or (_made_kinds(template, blocks, kinds_of) if kinds_of else None)
    parts = peak_parts(result.trace, made) if made is not None else None
    if parts is not None:
        bd = breakdown_of(*parts, result, device.margin)
    elif kinds_of:
        bd = None
    else:
        bds = [bd for _, bd in runs]
        bd = (extrapolated_breakdown(bds, blocks, (result.modelled_reserved_bytes, device.margin))
              if all(b is not None for b in bds) else None)
    if bd is None or (bd.peak_bytes, bd.tensor_peak_bytes) != (result.peak_bytes, result.peak_allocated_bytes):
        return None
    return dataclasses.replace(bd, step_peak_bytes=result.step_peak_bytes)  # (the made trace's, not a line's)


STATIC_LINES = ("weights_bytes", "gradients_bytes", "optimizer_bytes", "nf4_elements", "host_bytes",
                "steps_in_backward")


def extrapolated_static(statics: list[StaticMemory], blocks: int) -> StaticMemory | None:
    """The static memory (a rung's floor) at `blocks` from those at KEPT, KEPT+1, KEPT+2: each count on its line,
    the trained parameters' sizes those of the first plus a block's (the sizes the next adds, the same each time)
    for each block more; None where a count is off its line, a block adds other sizes, or anything else differs.
    The optimizer step's scratch is left out (0): it is a peak, not a sum of what each block holds, and three points
    on a line do not make it one (a BERT's 8-bit step: 112 KiB at 2, 3 and 4 layers, 145 KiB at 6). So the floor
    made is a bound under the whole model's: a rung passed on it cannot fit, one it lets through is tried."""
    first = statics[0]
    fields = {}
    for name in STATIC_LINES:
        fields[name] = _line([getattr(s, name) for s in statics], blocks)
        if fields[name] is None:
            return None
    sizes = [Counter(s.trained_sizes) for s in statics]
    block = sizes[1] - sizes[0]
    if any(b - a != block or a - b for a, b in zip(sizes, sizes[1:], strict=False)):
        return None
    fields["trained_sizes"] = tuple(sorted((sizes[0] + Counter({n: k * (blocks - KEPT) for n, k in block.items()}))
                                           .elements()))
    kept = (*STATIC_LINES, "trained_sizes", "step_temporaries_bytes")
    others = [dataclasses.replace(s, **{n: getattr(first, n) for n in kept}) for s in statics]
    if any(o != first for o in others):
        return None
    return dataclasses.replace(first, **fields, step_temporaries_bytes=0)
