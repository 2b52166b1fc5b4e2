"""Each life of a traced trial with its part of the breakdown (memory/life_kinds.py), and the parts at a trace's
peak read from them. No torch, no device: traces and records made by hand."""

from __future__ import annotations

from types import SimpleNamespace as R

from oomtune.memory.life_kinds import peak_parts, run_kinds
from oomtune.memory.replay import Trace

# a parameter alive before (storage 0), an activation (1) resized within its rounding and then past it, a scratch
# tensor (2) freed at once, a gradient (3)
EVENTS = (("mark", "forward"), ("set", 1, 1000), ("set", 1, 1010), ("set", 2, 2048), ("free", 2),
          ("set", 1, 1500), ("mark", "backward"), ("set", 3, 512), ("free", 1), ("mark", "optimizer"))
TRACE = Trace((1024,), EVENTS)
RECORDS = [R(key="w", at=None, nbytes=1024, kind="parameters"), R(key="a", at=1, nbytes=1024, kind="activations"),
           R(key="t", at=3, nbytes=2048, kind="temporaries"), R(key="a", at=5, nbytes=1536, kind="activations"),
           R(key="g", at=7, nbytes=512, kind="gradients")]


def _kind(r) -> str:
    return r.kind


def test_a_run_trials_lives_are_its_records_in_order_of_birth():
    """Each device set event that begins a life takes the next record born; a size within the same rounding
    begins none (None)."""
    assert run_kinds(TRACE, ["w"], RECORDS, _kind) == (
        ("parameters",), ("activations", None, "temporaries", "activations", "gradients"))
    assert run_kinds(TRACE, ["w"], RECORDS[:-1], _kind) is None  # a life no record stands for
    assert run_kinds(TRACE, ["w"], [*RECORDS, R(key="x", at=9, nbytes=512, kind="gradients")], _kind) is None
    assert run_kinds(TRACE, ["other"], RECORDS, _kind) is None  # the initial storage's record is not known


def test_the_parts_at_the_first_highest_peak():
    """The peak is the first time the live bytes are highest (the scratch tensor's, 1024 + 1024 + 2048), in its
    phase; the parts sum to it. Parts that do not fit the trace (one too few, a life where the run saw none): None."""
    kinds = run_kinds(TRACE, ["w"], RECORDS, _kind)
    assert peak_parts(TRACE, kinds) == ({"parameters": 1024, "activations": 1024, "temporaries": 2048}, "forward",
                                        4096)
    assert peak_parts(TRACE, (kinds[0], kinds[1][:-1])) is None
    assert peak_parts(TRACE, (kinds[0], ("activations", "activations", *kinds[1][2:]))) is None
    assert peak_parts(TRACE, ((), kinds[1])) is None
