"""The estimate's search for the longest context that fits, with micro-batch 1 at other contexts replayed from four
traced ones (memory/context_curves.py, search/prior.py ReplayingTrials): the same answer and the same figures for
every trial as with each context traced. Device: fake (the estimate's never-out twin), no card, no margin."""

from __future__ import annotations

import oomtune.search.prior as prior
from oomtune.model_file import load_model_file
from oomtune.search.estimate import estimate, make_fake_device
from oomtune.search.options import parse_levers, resolve_targets

from ..conftest import EXAMPLES


def _estimate():
    mf = load_model_file(EXAMPLES / "tiny_gpt.py")
    return estimate(mf, make_fake_device("8MiB", None, "0"), resolve_targets(mf, 8, 512, 32),
                    levers=parse_levers("amp,checkpointing,accumulation"))


def test_contexts_replayed_answer_as_every_context_traced(monkeypatch):
    """The tiny GPT in 8 MiB: micro-batch 1 does not fit 512 tokens at fp32 or bf16, and the ladder bisects the
    context. At fp32, 512, 32, 256 and 128 are traced and the rest replayed from their curves; under bf16 too, where
    the generic card's flash attention keeps its backward scratch at the context rounded up to 128 (a quadratic in
    that). Each trial's peak is the one traced, the plan and breakdown the same."""
    made = _estimate()
    monkeypatch.setattr(prior, "CHECKED", 1 << 30)  # (never enough contexts for curves: each one traced)
    traced = _estimate()
    assert made.plan == traced.plan and made.breakdown == traced.breakdown
    figures = lambda r: (r.rung, r.stage, r.micro_batch_size, r.context_length, r.peak_bytes, r.result)  # noqa: E731
    assert [figures(r) for r in made.search.records] == [figures(r) for r in traced.search.records]
    replayed = {(r.rung, r.context_length) for r in made.search.records
                if r.source == "replayed" and r.micro_batch_size == 1}
    assert {c for rung, c in replayed if rung == "fp32"} == {192, 224}, replayed
    assert {c for rung, c in replayed if rung == "amp"} == {320, 288}, replayed
    # the replayed micro-batch 1 at 192 lines up with micro-batch 3 traced there: micro-batch 2 is replayed too
    assert [r.source for r in made.search.records if (r.rung, r.micro_batch_size, r.context_length) ==
            ("fp32", 2, 192)] == ["replayed"]
    assert not any(r.source == "replayed" and r.micro_batch_size == 1 for r in traced.search.records)
