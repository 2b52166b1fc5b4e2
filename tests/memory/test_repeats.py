"""Template.fit on made-up traces (no torch, no device): runs of frees that look like one run; Template.refit of
another micro-batch's traces at two block counts."""

from __future__ import annotations

import pytest

from oomtune.memory.repeats import Template, without_last_frees
from oomtune.memory.replay import Trace


def _step(blocks: int, last_apart: int = 2, scale: int = 1) -> Trace:
    """A step's trace at `blocks` blocks: each block keeps a pair of 512-byte storages with `2` kept 8-byte ones
    between (`last_apart` in the last block); then a fresh pair a block; then one run of frees of all the pairs, in
    order of birth (as Trace.of keeps such a run), so the old pairs' frees and the fresh pairs' frees sit side by
    side; a last birth after them."""
    events: list[tuple] = [("mark", "forward")]
    born = [1]  # storage 0 is alive at the start

    def birth(size: int) -> int:
        events.append(("set", born[0], size))
        born[0] += 1
        return born[0] - 1

    pairs = []
    for t in range(blocks):
        first = birth(512 * scale)
        for _ in range(last_apart if t == blocks - 1 else 2):
            birth(8)
        pairs.append((first, birth(512 * scale)))
    events.append(("mark", "optimizer"))
    pairs += [(birth(512 * scale), birth(512 * scale)) for _ in range(blocks)]
    events += [("free", x) for x in sorted(x for pair in pairs for x in pair)]
    birth(4 * blocks * scale)
    return Trace((512,), tuple(events))


@pytest.mark.parametrize("last_apart", [2, 1], ids=["alike", "last-block-differs"])
def test_two_runs_of_frees_side_by_side_are_told_apart(last_apart):
    """The extra block's two pairs of frees are inserted next to each other and look like one period of four, whose
    storage rules are not affine; laid out as two runs of pairs (the first less its last period where the last
    block's pair was born closer), the traces at 2, 3 and 4 blocks fit and the trace at 9 is the one made at 9."""
    traces = [_step(n, last_apart) for n in (2, 3, 4)]
    template = Template.fit(traces, 2)
    assert template is not None
    assert template.at(9) == without_last_frees(_step(9, last_apart))


def test_another_micro_batch_is_refitted_on_two_block_counts():
    """The template fitted on 2, 3 and 4 blocks at one scale, refitted on the traces of 2 and 3 blocks at another
    (each size's rule a line through two points): the trace at 9 blocks is the one made at 9 at that scale, the
    stack of one value a block per sample (4 x blocks x scale bytes) included."""
    template = Template.fit([_step(n) for n in (2, 3, 4)], 2)
    refitted = template.refit([_step(n, scale=32) for n in (2, 3)])
    assert refitted is not None
    assert refitted.at(9) == without_last_frees(_step(9, scale=32))
    assert refitted.at(4) == without_last_frees(_step(4, scale=32))


def test_traces_laid_out_otherwise_are_not_refitted():
    """Where the last block differs in the refitted traces but not in the template's (or one trace is missing), the
    layout does not make them: None, and the caller traces a third block count and fits as ever."""
    template = Template.fit([_step(n) for n in (2, 3, 4)], 2)
    assert template.refit([_step(n, last_apart=1, scale=32) for n in (2, 3)]) is None
    assert template.refit([_step(2, scale=32)]) is None
    assert template.refit([_step(2, scale=32), _step(4, scale=32)]) is None
