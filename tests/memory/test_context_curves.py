"""Another context's trace made from traces at four contexts (memory/context_curves.py): each size on a quadratic in
the context, fitted on three and checked on the fourth. No torch: traces made by hand."""

from __future__ import annotations

from oomtune.memory.context_curves import Curves
from oomtune.memory.replay import Trace


def _trace(t: int, scores=lambda t: 4 * t * t, mask=lambda t: t * (t + 1) // 2, kind: str = "set") -> Trace:
    """A step at context t: an activation (t x 64 fp32), eager attention's scores (t x t fp32), a triangular
    mask's bytes (not whole-number coefficients), a constant; the scratch freed."""
    return Trace((4096,), (("mark", "forward"), (kind, 1, 256 * t), ("set", 2, scores(t)), ("set", 3, mask(t)),
                           ("free", 2), ("set", 4, 512), ("free", 3), ("mark", "backward")))


def test_four_contexts_make_any_other_to_the_byte():
    """Fitted on 512, 32, 256, checked on 128: the trace at 96, 192, 1024 or 4096 is the one traced there. At 33 it
    is not made: four multiples of 32 cannot tell T from T rounded up to 32, and there the two differ."""
    curves = Curves.through([(t, _trace(t)) for t in (512, 32, 256, 128)])
    assert curves is not None
    for t in (96, 192, 1024, 4096):
        assert curves.at(t) == _trace(t)
    assert curves.at(33) is None


def test_three_contexts_are_not_enough_and_a_size_off_its_curve_is_refused():
    """Three points fit any sizes: nothing without a fourth. A size padded to a multiple of 100 (no kernel's) is no
    quadratic in the context, nor in it rounded to 32 or 128: the fourth context is off every curve, no curves."""
    assert Curves.through([(t, _trace(t)) for t in (512, 32, 256)]) is None
    padded = lambda t: 16 * -(-t // 100) * 100  # noqa: E731
    assert Curves.through([(t, _trace(t, scores=padded)) for t in (512, 32, 256, 384)]) is None
    assert Curves.through([(t, _trace(t)) for t in (512, 32, 256, 256)]) is None  # (a context twice)
    # a size flat below 128 tokens: rounded up to 128, 512, 32, 256 and 128 are 512, 128, 256 and 128 again, so
    # the fourth does not check the curve in T rounded to 128 (which would make 160 as 256 tokens): none
    floor = lambda t: 1024 * max(t, 128)  # noqa: E731
    assert Curves.through([(t, _trace(t, scores=floor)) for t in (512, 32, 256, 128)]) is None


def test_a_size_padded_as_flash_attention_pads_it_is_made_where_the_contexts_tell():
    """Flash attention's backward keeps (B, H, T rounded up to 128) fp32: a line in T rounded to 128, which the
    four contexts (32 and 384 among them) tell from a line in T; the trace at 160 or 992 is the traced one. Four
    contexts that are all multiples of 128 cannot tell the two apart: the trace at 640 is made (both agree), at
    160 it is not (they differ), and that context is traced."""
    padded = lambda t: 16 * -(-t // 128) * 128  # noqa: E731
    curves = Curves.through([(t, _trace(t, scores=padded)) for t in (512, 32, 256, 384)])
    assert curves is not None
    assert curves.at(160) == _trace(160, scores=padded) and curves.at(992) == _trace(992, scores=padded)
    aligned = Curves.through([(t, _trace(t, scores=padded)) for t in (512, 128, 256, 384)])
    assert aligned is not None and aligned.at(640) == _trace(640, scores=padded) and aligned.at(160) is None


def test_traces_that_do_not_line_up_are_refused():
    """Another kind of event (a storage in host memory at one context), or a storage more: no curves."""
    points = [(t, _trace(t)) for t in (512, 32, 256)]
    assert Curves.through([*points, (128, _trace(128, kind="hset"))]) is None
    longer = Trace(_trace(128).initial, (*_trace(128).events, ("set", 5, 512)))
    assert Curves.through([*points, (128, longer)]) is None


def test_no_trace_where_a_size_is_not_whole_or_below_zero():
    """A quadratic with a fractional coefficient made at a context where it gives no whole bytes, or a line that
    goes below zero there: None, the trial is traced instead."""
    half = lambda t: t * t // 2 if t % 2 == 0 else None  # noqa: E731  (t*t/2: whole at even t only)
    curves = Curves.through([(t, _trace(t, mask=half)) for t in (512, 32, 256, 128)])
    assert curves is not None and curves.at(64) == _trace(64, mask=half) and curves.at(63) is None
    falling = Curves.through([(t, _trace(t, scores=lambda t: 10_000 - 8 * t)) for t in (512, 32, 256, 128)])
    assert falling is not None and falling.at(1024) is not None and falling.at(2048) is None
