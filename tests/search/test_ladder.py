"""The ladder search, torch-free, against fake memory functions: exact sequences of sizes tried."""

import subprocess
import sys

import pytest

from oomtune.search.ladder import LadderSearch, Measurement, Point, Rung, context_candidates, largest_divisor_at_most

FP32 = Rung("fp32", "fp32", False)
AMP = Rung("amp", "bf16", False)
CKPT = Rung("checkpointing", "bf16", True)
BUDGET = 2000
LIMIT = 1800  # 10% headroom


def fake_device(peak_of, budget=BUDGET, speed_of=None):
    """measure(point): OOM past the budget (no peak, like the allocator), else the peak (and a speed)."""

    def measure(p: Point) -> Measurement:
        peak = peak_of(p)
        if peak > budget:
            return Measurement(oom=True)
        return Measurement(oom=False, peak_bytes=peak, tokens_per_s=speed_of(p) if speed_of else 1.0)

    return measure


def sizes(search):
    return [(t.point.micro_batch_size, t.point.context_length, t.point.grad_accum_steps, t.stage)
            for t in search.trials]


def test_search_module_does_not_import_torch():
    code = "import sys, oomtune.search; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_affine_memory_is_found_with_one_prediction_and_one_verify():
    # peak = 1000 + 60 b: the largest b under 1800 is 13
    s = LadderSearch(fake_device(lambda p: 1000 + 60 * p.micro_batch_size), LIMIT)
    r = s.search_rung(FP32, batch=64, context=128, min_context=128)
    assert (r.context_length, r.micro_batch_size, r.trials) == (128, 13, 5)
    assert sizes(s) == [(64, 128, 1, "target"), (1, 128, 1, "context"),
                        (8, 128, 1, "batch"),  # the second point: the geometric middle of 1..64
                        (13, 128, 1, "batch"),  # the line through 1 and 8: 8 + (1800 - 1480) // 60
                        (14, 128, 1, "verify")]
    assert [t.result for t in s.trials] == ["oom", "fits", "fits", "fits", "over-headroom"]


def test_a_prediction_that_misses_falls_back_to_bisection_then_the_chord():
    # small batches peak in a flat phase (the optimizer step): 1 and 8 cost about the same, so the line through
    # them predicts far too much. Truth: max(1500 + 5b, 1200 + 25b) <= 1800 -> b = 24.
    peak = lambda p: max(1500 + 5 * p.micro_batch_size, 1200 + 25 * p.micro_batch_size)  # noqa: E731
    s = LadderSearch(fake_device(peak), LIMIT)
    r = s.search_rung(FP32, batch=64, context=128, min_context=128)
    assert r.micro_batch_size == 24
    assert [b for b, *_ in sizes(s)] == [
        64,  # target: OOM
        1, 8,  # two points: 1505, 1540 -> the line predicts 8 + 260 // 5 = 60
        60,  # the prediction misses: OOM outright, no peak to refit with
        34,  # the line still points past what failed, so bisect (8 + 60) // 2: OOM
        21,  # bisect again (8 + 34) // 2: fits (1725)
        26,  # the line through 8 and 21 predicts 26: 1850, over the limit but under budget -> a bracket
        24,  # the chord 21 + (1800 - 1725) * 5 // 125 = 24: fits (a chord never overshoots a convex peak)
        25,  # verify: over the limit -> 24
    ]
    assert [t.stage for t in s.trials][-1] == "verify"


def test_memory_that_does_not_grow_with_batch_bisects_instead_of_walking():
    s = LadderSearch(fake_device(lambda p: 1000 if p.micro_batch_size < 40 else 5000), LIMIT)
    r = s.search_rung(FP32, batch=64, context=128, min_context=128)
    # 64 OOM; 1 and 8 cost the same, so the line says "anything fits" -- past 64, known not to: bisect
    assert r.micro_batch_size == 39
    assert [b for b, *_ in sizes(s)] == [64, 1, 8, 36, 50, 43, 39, 41, 40]


def test_memory_that_does_not_grow_tries_the_target_when_nothing_is_known_to_fail():
    s = LadderSearch(fake_device(lambda p: 1000 + 100 * p.micro_batch_size), LIMIT)
    s.check(Point(FP32, 1, 128), "context")
    assert s.largest_batch(FP32, 128, 5) == 5
    assert [b for b, *_ in sizes(s)] == [1, 2, 5]  # the line predicts 8 > 5: try the target itself


def test_context_is_searched_before_batch_and_cut_only_to_candidates():
    assert context_candidates(64, 256) == [64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256]
    assert context_candidates(1000, 1024) == [1000, 1024]
    assert context_candidates(5, 5) == [5]
    # peak = 1600 + b*T: micro-batch 1 fits up to T = 200, so the largest candidate is 192
    s = LadderSearch(fake_device(lambda p: 1600 + p.micro_batch_size * p.context_length), LIMIT)
    r = s.search_rung(FP32, batch=8, context=256, min_context=64)
    assert (r.context_length, r.micro_batch_size) == (192, 1)
    assert [(b, t, stage) for b, t, _, stage in sizes(s)] == [
        (8, 256, "target"), (1, 256, "context"), (1, 64, "context"),  # T does not fit, T_min does
        (1, 160, "context"), (1, 208, "context"), (1, 176, "context"), (1, 192, "context"),  # bisect candidates
        (3, 192, "batch"),  # the geometric middle of 1..9 (8 never ran at 192): 2176, OOM
        (2, 192, "batch"),  # 1984: over the limit -> micro-batch 1 at 192
    ]


def test_context_is_never_cut_unless_allowed():
    s = LadderSearch(fake_device(lambda p: 1600 + p.micro_batch_size * p.context_length), LIMIT)
    r = s.search_rung(FP32, batch=8, context=256, min_context=256)
    assert not r.found and r.trials == 2


def test_ladder_stops_at_the_first_rung_that_fits_the_target():
    # fp32: 200/sample, amp: 100/sample, ckpt: 50/sample, all on top of 1000
    per = {"fp32": 200, "amp": 100, "checkpointing": 50}
    s = LadderSearch(fake_device(lambda p: 1000 + per[p.rung.name] * p.micro_batch_size), LIMIT)
    result = s.run([FP32, AMP, CKPT], batch=8, context=128, min_context=128)
    assert [r.rung.name for r in result.rungs] == ["fp32", "amp"]  # amp fits 8 x 128 outright: stop
    assert [(r.micro_batch_size, r.trials) for r in result.rungs] == [(4, 5), (8, 1)]
    c = result.choice
    assert (c.rung, c.micro_batch_size, c.grad_accum_steps, c.global_batch_size) == (AMP, 8, 1, 8)


def test_accumulation_keeps_the_global_batch_exact_and_is_verified():
    # the best rung fits 7 per micro-batch; B = 12 -> micro-batch 6 x 2 (7 does not divide 12)
    s = LadderSearch(fake_device(lambda p: 1100 + 100 * p.micro_batch_size), LIMIT)
    result = s.run([FP32], batch=12, context=128, min_context=128)
    assert result.rungs[0].micro_batch_size == 7
    c = result.choice
    assert (c.micro_batch_size, c.grad_accum_steps, c.global_batch_size) == (6, 2, 12)
    assert sizes(s)[-1] == (6, 128, 2, "verify")
    # a prime global batch is still exact: 1 x 13
    assert largest_divisor_at_most(13, 7) == 1
    assert largest_divisor_at_most(12, 7) == 6


def test_accumulation_that_itself_does_not_fit_steps_down_to_the_next_divisor():
    # accumulating gradients costs an extra 150 bytes (a second gradient buffer while the next micro-step runs)
    peak = lambda p: 1100 + 100 * p.micro_batch_size + (150 if p.grad_accum_steps > 1 else 0)  # noqa: E731
    s = LadderSearch(fake_device(peak), LIMIT)
    c = s.run([FP32], batch=12, context=128, min_context=128).choice
    assert (c.micro_batch_size, c.grad_accum_steps) == (4, 3)
    assert [x for x in sizes(s) if x[3] == "verify" and x[2] > 1] == [(6, 128, 2, "verify"), (4, 128, 3, "verify")]


def test_best_rung_prefers_context_then_batch_then_the_earlier_rung():
    # no rung reaches the target; amp and ckpt both fit 5 -> the earlier (amp) wins, it recomputes nothing
    per = {"fp32": 300, "amp": 150, "checkpointing": 150}
    s = LadderSearch(fake_device(lambda p: 1000 + per[p.rung.name] * p.micro_batch_size), LIMIT)
    result = s.run([FP32, AMP, CKPT], batch=16, context=64, min_context=64)
    assert [r.micro_batch_size for r in result.rungs] == [2, 5, 5]
    assert result.choice.rung == AMP and result.choice.micro_batch_size == 4  # 4 x 4 = 16


def test_a_later_rung_whose_plan_fits_larger_wins_over_an_earlier_one_that_had_to_step_down():
    """fp32 fits 5 alone, amp 6; B = 16 would run 4 x 4 on either, but accumulation costs fp32 300 bytes more, so
    its plan steps down to 2 x 8; amp's 4 x 4 fits and is chosen (the largest plan that fits, as the bench's truth
    has it), not fp32's smaller one for being earlier."""
    per = {"fp32": 150, "amp": 130}
    s = LadderSearch(fake_device(lambda p: 1000 + per[p.rung.name] * p.micro_batch_size
                                 + (300 if p.rung == FP32 and p.grad_accum_steps > 1 else 0)), LIMIT)
    result = s.run([FP32, AMP], batch=16, context=64, min_context=64)
    assert [r.micro_batch_size for r in result.rungs] == [5, 6]
    assert (result.choice.rung, result.choice.micro_batch_size, result.choice.grad_accum_steps) == (AMP, 4, 4)
    verified = [(p.rung.name, p.micro_batch_size) for p in (t.point for t in s.trials) if p.grad_accum_steps > 1]
    assert verified == [("fp32", 4), ("fp32", 2), ("amp", 4)]


def test_rungs_whose_plans_run_the_same_micro_batch_go_to_the_earlier_rung():
    """What runs is the plan: fp32 fits 5 and amp 7 alone, but B = 16 runs 4 x 4 on either, so fp32's plan is
    chosen (the ordering of the exhaustive truth in the bench: the largest plan micro-batch, then the earliest rung),
    not amp's for a micro-batch 7 it would never run."""
    per = {"fp32": 150, "amp": 110}
    s = LadderSearch(fake_device(lambda p: 1000 + per[p.rung.name] * p.micro_batch_size), LIMIT)
    result = s.run([FP32, AMP], batch=16, context=64, min_context=64)
    assert [r.micro_batch_size for r in result.rungs] == [5, 7]
    assert (result.choice.rung, result.choice.micro_batch_size, result.choice.grad_accum_steps) == (FP32, 4, 4)


def test_throughput_objective_measures_every_rung_and_picks_the_fastest():
    per = {"fp32": 50, "amp": 40, "checkpointing": 20}
    speed = {"fp32": 900.0, "amp": 1500.0, "checkpointing": 700.0}
    s = LadderSearch(fake_device(lambda p: 1000 + per[p.rung.name] * p.micro_batch_size,
                                 speed_of=lambda p: speed[p.rung.name]), LIMIT)
    result = s.run([FP32, AMP, CKPT], batch=16, context=64, min_context=64, objective="throughput")
    assert len(result.rungs) == 3  # fp32 fits outright, but every rung is measured
    assert result.choice.rung == AMP


def test_a_point_is_never_measured_twice():
    calls = []

    def measure(p):
        calls.append(p)
        return Measurement(oom=False, peak_bytes=100, tokens_per_s=1.0)

    s = LadderSearch(measure, LIMIT)
    assert s.check(Point(FP32, 3, 8), "batch") and s.check(Point(FP32, 3, 8), "batch")
    assert len(calls) == 1 and len(s.trials) == 1


@pytest.mark.parametrize("batch", [1, 2, 3, 17, 100])
@pytest.mark.parametrize("slope", [1, 37, 250])
def test_the_answer_equals_exhaustive_search(batch, slope):
    peak = lambda p: 1000 + slope * p.micro_batch_size  # noqa: E731
    s = LadderSearch(fake_device(peak), LIMIT)
    r = s.search_rung(FP32, batch=batch, context=16, min_context=16)
    truth = max(b for b in range(1, batch + 1) if peak(Point(FP32, b, 16)) <= LIMIT)
    assert r.micro_batch_size == truth


def test_a_plan_that_steps_down_to_what_an_earlier_rung_fits_goes_to_the_earlier_rung():
    """amp fits micro-batch 18 alone, checkpointing 32; accumulation holds 250 more bytes, so checkpointing's 32 x 2
    does not fit and its plan steps down to 16 x 4, which amp fits too: the plan is amp's (no recompute), where it
    used to be checkpointing's."""
    def peak(p: Point) -> int:
        per_sample = {FP32: 200, AMP: 90, CKPT: 40}[p.rung]
        return 100 + per_sample * p.micro_batch_size + (250 if p.grad_accum_steps > 1 else 0) + (
            200 if p.rung == CKPT and p.grad_accum_steps > 1 else 0)

    s = LadderSearch(fake_device(peak), LIMIT)
    r = s.run([FP32, AMP, CKPT], batch=64, context=8, min_context=8)
    assert [x.micro_batch_size for x in r.rungs] == [8, 18, 42]
    assert (r.choice.rung, r.choice.micro_batch_size, r.choice.grad_accum_steps) == (AMP, 16, 4)
    assert [z for z in sizes(s) if z[2] > 1] == [(32, 8, 2, "verify"), (16, 8, 4, "verify"), (16, 8, 4, "verify")]


def test_a_context_is_cut_further_where_accumulation_does_not_fit_at_the_rungs_context():
    """Micro-batch 1 fits alone up to 1024 (checkpointing) and 768 (amp), but accumulation keeps the gradients
    (300 here) alive: 1 x 8 fits at neither. The context is cut further, towards --min-context: the longest at which
    1 x 8 fits on the rung with the longest T_S, and there the largest plan. The amp rung (T_S 768) cannot beat 832
    and is not searched. Before, this was "nothing fits" with a plan at 832 within reach."""
    def peak(p):
        per_token = 8 if p.rung == AMP else 6
        return 500 + 300 * (p.grad_accum_steps > 1) + p.micro_batch_size * p.context_length * per_token // 5

    s = LadderSearch(fake_device(peak), LIMIT)
    r = s.run([AMP, CKPT], batch=8, context=1024, min_context=128)
    assert [(x.rung, x.context_length, x.micro_batch_size) for x in r.rungs] == [(AMP, 768, 1), (CKPT, 1024, 1)]
    c = r.choice
    assert (c.rung, c.micro_batch_size, c.context_length, c.grad_accum_steps) == (CKPT, 1, 832, 8)
    tail = [(t.point.rung.name, *size) for t, size in zip(s.trials, sizes(s), strict=True)][12:]
    assert tail == [("checkpointing", 1, 1024, 8, "verify"), ("amp", 1, 768, 8, "verify"),  # choose(): no plan
                    ("checkpointing", 1, 128, 8, "context"), ("checkpointing", 1, 576, 8, "context"),
                    ("checkpointing", 1, 768, 8, "context"), ("checkpointing", 1, 896, 8, "context"),
                    ("checkpointing", 1, 832, 8, "context"),  # the longest at which 1 x 8 fits: 832
                    ("checkpointing", 1, 832, 1, "batch"), ("checkpointing", 3, 832, 1, "batch"),
                    ("checkpointing", 2, 832, 1, "batch")]  # the largest alone there: 1, so 1 x 8


def test_nothing_fits_where_even_the_shortest_context_cannot_accumulate():
    peak = lambda p: 500 + 1500 * (p.grad_accum_steps > 1) + p.micro_batch_size * p.context_length  # noqa: E731
    s = LadderSearch(fake_device(peak), LIMIT)
    r = s.run([CKPT], batch=8, context=1024, min_context=128)
    assert r.choice is None and r.rungs[0].context_length == 1024
    assert sizes(s)[-1] == (1, 128, 8, "context")  # tried once at --min-context, then given up


def test_peaks_that_move_in_steps_are_galloped_once_two_sizes_read_the_same():
    """A card's allocator model reserves 2 MiB segments: a small model's peak moves in steps many sizes wide. The
    chord from micro-batch 1 lands on the step at the limit, and the chord and its verify then walked that step
    one size at a time (25 trials here, 41 on one rung of a user's model). Once two sizes that fit read the same
    peak, the search gallops up from the largest that fits, by the widest flat run seen (at least 2), doubling,
    never past the midpoint. Truth: 1000 + 100 * ceil(b / 25) <= 1800 -> b = 200."""
    peak = lambda p: 1000 + 100 * -(-p.micro_batch_size // 25)  # noqa: E731
    s = LadderSearch(fake_device(peak, budget=3000), LIMIT)
    r = s.search_rung(FP32, batch=256, context=64, min_context=64)
    assert r.micro_batch_size == 200
    assert [b for b, *_ in sizes(s)] == [
        256,  # target: over the limit (2100), under the budget: its peak is the chord's end
        1,  # context: fits (1100)
        179,  # the chord from 1 to 256: 1 + 700 * 255 // 1000 (1800, at the limit: it fits)
        180,  # the chord from 179 says nothing larger fits; 180 does, at the same peak: in steps
        182, 186, 194,  # gallop: +2, +4, +8 (all 1800)
        210,  # +16 (1900: over)
        202, 198, 200, 201,  # bisect between 194 and 210
    ]
    assert len(s.trials) == 12  # against 25 walking the step
