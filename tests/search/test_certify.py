"""The probe that starts from the estimate (search/certify.py), torch-free: the exact sizes it tries against a
device whose memory is a line in the micro-batch, with a prior that is right, off by a constant, off by a
proportion, and wrong enough to fall back."""

from __future__ import annotations

import pytest

from oomtune.search.certify import CertifyingSearch, RungPrior, priors_from
from oomtune.search.ladder import LadderSearch, Measurement, Point, Rung

FP32 = Rung("fp32", "fp32", False)
LIMIT, BUDGET = 1000, 1100  # a trial fits at a peak <= LIMIT; past BUDGET it runs out of memory


def fake_peak(b: int) -> int:
    return 100 + 10 * b  # the estimate's line: micro-batch 90 fits the limit exactly, 91 does not


def prior(context: int = 64, chosen: bool = True) -> RungPrior:
    """What the estimate measured on the way to 90 (the sizes its own search ran), on the rung it chose."""
    return RungPrior(context, 90, tuple((b, fake_peak(b)) for b in (1, 16, 90, 91)), chosen=chosen)


def device(peak, context_cap: int = 64):
    """measure(): the device's peak as a function of the micro-batch; micro-batch 1 runs out past context_cap."""
    def measure(point: Point) -> Measurement:
        if point.context_length > context_cap:
            return Measurement(oom=True)
        p = peak(point.micro_batch_size)
        return Measurement(oom=True) if p > BUDGET else Measurement(oom=False, peak_bytes=p)
    return measure


def run(peak, rung_prior: RungPrior | None, batch: int = 256, context: int = 64, min_context: int = 64,
        context_cap: int = 64):
    """One rung certified alone (the largest micro-batch without accumulation, as under the throughput objective)."""
    search = CertifyingSearch(device(peak, context_cap), LIMIT, {FP32: rung_prior} if rung_prior else {})
    result = search.search_rung(FP32, batch, context, min_context)
    tried = [(t.point.micro_batch_size, t.point.context_length, t.stage, t.result) for t in search.trials]
    return result, tried, search.fell_back


def test_a_right_prior_is_certified_in_two_trials():
    result, tried, fell_back = run(fake_peak, prior())
    assert tried == [(90, 64, "prior", "fits"), (91, 64, "verify", "over-headroom")]
    assert (result.context_length, result.micro_batch_size, result.trials, fell_back) == (64, 90, 2, [])


def test_a_prior_off_by_a_constant_is_corrected_from_the_measured_point():
    """The device adds 50 bytes the estimate cannot see: 90 goes over, its offset predicts 85 exactly."""
    result, tried, _ = run(lambda b: fake_peak(b) + 50, prior())
    assert tried == [(90, 64, "prior", "over-headroom"), (85, 64, "corrected", "fits"),
                     (86, 64, "verify", "over-headroom")]
    assert result.micro_batch_size == 85


def test_a_prior_off_by_a_proportion_is_corrected_with_a_line_through_two_offsets():
    """20% more than the estimate: 90 runs out of memory outright, leaving no peak, so the next size assumes the
    prior as far off as it may be (25%: 70), which fits, and so does 71; the line through the offsets at 70 and 71 is
    the device's own, and predicts 73 exactly."""
    result, tried, fell_back = run(lambda b: fake_peak(b) * 6 // 5, prior())
    assert tried == [(90, 64, "prior", "oom"), (70, 64, "corrected", "fits"), (71, 64, "verify", "fits"),
                     (73, 64, "corrected", "fits"), (74, 64, "verify", "over-headroom")]
    assert (result.micro_batch_size, fell_back) == (73, [])
    assert max(b for b in range(1, 257) if fake_peak(b) * 6 // 5 <= LIMIT) == 73  # the truth


def test_a_prior_wrong_enough_falls_back_to_the_search_which_keeps_what_ran():
    """60% over the estimate: 90 runs out of memory, and so does 70, where a prior 25% off would have fit: not a
    shifted line but another shape of memory. The rung is searched as without a prior, knowing those two trials,
    and finds the truth."""
    peak = lambda b: fake_peak(b) * 8 // 5  # noqa: E731
    result, tried, fell_back = run(peak, prior())
    assert tried[:2] == [(90, 64, "prior", "oom"), (70, 64, "corrected", "oom")] and fell_back == ["fp32"]
    assert {t[2] for t in tried[2:]} <= {"target", "context", "batch", "verify"}  # the search's own stages
    assert len({t[:2] for t in tried}) == len(tried)  # no size ran twice
    assert result.micro_batch_size == max(b for b in range(1, 257) if peak(b) <= LIMIT) == 52
    plain = LadderSearch(device(peak), LIMIT)
    assert plain.search_rung(FP32, 256, 64, 64).micro_batch_size == 52


def test_a_first_peak_far_off_falls_back_at_once():
    """The device's first peak 40% under the estimate's: the prior is not describing this device."""
    result, tried, fell_back = run(lambda b: fake_peak(b) * 3 // 5, prior())
    assert tried[0] == (90, 64, "prior", "fits") and fell_back == ["fp32"]
    assert result.micro_batch_size == 156


def test_a_prior_that_cut_the_context_is_certified_by_the_next_context_not_fitting():
    """The estimate found context 48 (of 64, at least 16): micro-batch 1 at 52, the next the search could pick, must
    not fit; then the batch at 48 as before."""
    result, tried, _ = run(fake_peak, prior(context=48), context=64, min_context=16, context_cap=48)
    assert tried == [(1, 52, "prior", "oom"), (90, 48, "prior", "fits"), (91, 48, "verify", "over-headroom")]
    assert (result.context_length, result.micro_batch_size) == (48, 90)


def test_a_prior_that_fits_nothing_is_certified_by_one_trial():
    result, tried, _ = run(fake_peak, RungPrior(None, None), context_cap=0)
    assert tried == [(1, 64, "prior", "oom")] and not result.found


@pytest.mark.parametrize("target", [90, 60])
def test_the_target_batch_needs_no_next_size(target):
    """A prior of the whole target batch (here capped by it): it fits, and there is no larger size to try."""
    result, tried, _ = run(fake_peak, RungPrior(64, target, prior().peaks), batch=target)
    assert tried == [(target, 64, "prior", "fits")] and result.micro_batch_size == target


def test_a_rung_that_falls_back_runs_nothing_known_not_to_fit():
    """The context certified (micro-batch 1 at 52 runs out), then the batch at 48 60% over the estimate: the search
    the rung falls back to knows that 52 ran out, so it runs neither its target (256 at 64) nor micro-batch 1 at 64,
    nor any context past 52, each of which could only run out of memory too."""
    peak = lambda b: fake_peak(b) * 8 // 5  # noqa: E731
    result, tried, fell_back = run(peak, prior(context=48), context=64, min_context=16, context_cap=48)
    assert tried[0] == (1, 52, "prior", "oom") and fell_back == ["fp32"]
    assert not [t for t in tried[1:] if t[1] >= 52]
    assert (result.context_length, result.micro_batch_size) == (48, 52)


# -- the plan certified, where the rung will accumulate (the fit objective) --------------------------------------

GRADS = 30  # accumulation keeps the gradients alive through the next micro-step: a plan with it peaks higher


def with_accumulation(peak, grads: int = GRADS):
    """measure(): `peak` of the micro-batch, plus `grads` where the plan accumulates."""
    def measure(point: Point) -> Measurement:
        p = peak(point.micro_batch_size) + (grads if point.grad_accum_steps > 1 else 0)
        return Measurement(oom=True) if p > BUDGET else Measurement(oom=False, peak_bytes=p)
    return measure


def climb(peak, rung_prior: RungPrior, batch: int = 256, objective: str = "fit", grads: int = GRADS):
    search = CertifyingSearch(with_accumulation(peak, grads), LIMIT, {FP32: rung_prior})
    result = search.run([FP32], batch, 64, 64, objective)
    tried = [(t.point.micro_batch_size, t.point.grad_accum_steps, t.stage, t.result) for t in search.trials]
    c = result.choice
    return result.rungs[0], tried, (c.micro_batch_size, c.grad_accum_steps) if c else None


def test_a_rung_that_will_accumulate_is_certified_by_its_plan_in_two_trials():
    """90 fits alone, so B = 256 runs as 64 x 4: the plan fits, the next divisor's (128 x 2) does not, and the plan
    needs no trial of its own. The largest micro-batch alone (90) is not tried for: nothing would run it."""
    rung, tried, plan = climb(fake_peak, prior())
    assert tried == [(64, 4, "prior", "fits"), (128, 2, "verify", "oom")]
    assert (rung.micro_batch_size, rung.grad_accum_steps, rung.trials, plan) == (64, 4, 2, (64, 4))


def test_a_plan_that_does_not_fit_steps_to_the_divisor_below():
    """300 bytes the estimate cannot see: 64 x 4 goes over, 32 x 8 fits, and 64 x 4 is already the next divisor's
    plan known not to fit. The plan stepped down, so one trial checks it is still within a factor of two of what
    fits alone: 64 alone does not fit, so nothing more is needed (no divisor note to give)."""
    rung, tried, plan = climb(lambda b: fake_peak(b) + 300, prior())
    assert tried == [(64, 4, "prior", "over-headroom"), (32, 8, "corrected", "fits"),
                     (64, 1, "verify", "over-headroom")]
    assert plan == (32, 8) and (rung.trials, rung.grad_accum_steps) == (3, 8)


def test_a_plan_that_stepped_down_below_half_of_what_fits_alone_certifies_the_rung_alone_too():
    """Accumulation costs 400 bytes more than the estimate knew: 64 x 4 runs out, 32 x 8 fits, and 64 alone fits,
    so the plan runs at half of what fits alone or less: the rung is certified alone (90 fits, 91 does not), and
    the plan is the one already certified, with no trial of its own; the probe can then say why (divisor_note)."""
    rung, tried, plan = climb(fake_peak, prior(), grads=400)
    assert tried == [(64, 4, "prior", "oom"), (32, 8, "corrected", "fits"), (64, 1, "verify", "fits"),
                     (90, 1, "prior", "fits"), (91, 1, "verify", "over-headroom")]
    assert (rung.micro_batch_size, rung.grad_accum_steps, plan) == (90, 1, (32, 8))


def test_a_plan_that_stepped_down_on_a_rung_the_estimate_did_not_choose_is_not_checked_alone():
    """As above, but on a rung the estimate did not choose: no divisor note will speak of it, so the plan certified
    in two trials (64 x 4 out, 32 x 8 fits) is the rung's answer, with no trial alone."""
    rung, tried, plan = climb(fake_peak, prior(chosen=False), grads=400)
    assert tried == [(64, 4, "prior", "oom"), (32, 8, "corrected", "fits")]
    assert (rung.micro_batch_size, rung.grad_accum_steps, rung.trials, plan) == (32, 8, 2, (32, 8))


def test_the_estimates_own_plan_is_where_the_device_starts():
    """The estimate verified its plan with accumulation (32 x 8: 64 x 4 did not fit on fake tensors either): the
    device starts there, not at the largest divisor under 90."""
    rung, tried, plan = climb(fake_peak, RungPrior(64, 60, prior().peaks, plan_micro_batch=32, chosen=True), grads=400)
    assert tried[0] == (32, 8, "prior", "fits") and plan == (32, 8)


def test_without_accumulation_no_plan_is_certified():
    """--levers without accumulation: a plan must fit the whole batch at once, so nothing runs with accumulation."""
    search = CertifyingSearch(with_accumulation(fake_peak), LIMIT, {FP32: prior()})
    result = search.run([FP32], 256, 64, 64, accumulation=False)
    assert all(t.point.grad_accum_steps == 1 for t in search.trials) and result.choice is None
    assert [t.point.micro_batch_size for t in search.trials] == [90, 91]


def test_a_prior_of_the_whole_target_is_tried_alone():
    """The estimate says the target fits: the target alone, one trial, no plan."""
    rung, tried, plan = climb(fake_peak, RungPrior(64, 90, prior().peaks), batch=90)
    assert tried == [(90, 1, "prior", "fits")] and plan == (90, 1)


def test_a_plan_the_prior_is_far_below_is_certified_alone_after_four_steps():
    """B = 720 (30 divisors), the device holding a fifth of the estimate's memory: the plan steps up from 90 x 8
    four times and still fits (120, 144, 180), so the rung is certified alone instead of stepping on; that prior is
    far off too, so the rung falls back to the search (490 alone), and the plan is verified after: 360 x 2."""
    rung, tried, plan = climb(lambda b: fake_peak(b) // 5, prior(), batch=720)
    assert [t[:2] for t in tried[:4]] == [(90, 8), (120, 6), (144, 5), (180, 4)]
    assert all(t[3] == "fits" for t in tried[:4]) and tried[4] == (90, 1, "prior", "fits")
    assert (rung.micro_batch_size, rung.grad_accum_steps, plan) == (490, 1, (360, 2))


def test_a_plan_with_room_to_spare_steps_up_to_the_target():
    """Half the estimate's memory: 64 x 4 and 128 x 2 fit, 256 alone (the target) does not."""
    rung, tried, plan = climb(lambda b: fake_peak(b) // 2, prior())
    assert tried == [(64, 4, "prior", "fits"), (128, 2, "verify", "fits"), (256, 1, "verify", "oom")]
    assert plan == (128, 2) and rung.grad_accum_steps == 2


def test_far_below_what_fits_the_rung_is_certified_alone_for_the_divisor_note():
    """B = 91 (7 x 13) with 90 fitting: its plan 13 x 7 is far below 90, so the rung is certified alone (90 fits, 91
    does not), then the plan verified, as without a prior: the probe can say what would run at 90."""
    rung, tried, plan = climb(fake_peak, prior(), batch=91)
    assert tried == [(90, 1, "prior", "fits"), (91, 1, "verify", "over-headroom"), (13, 7, "verify", "fits")]
    assert (rung.micro_batch_size, rung.grad_accum_steps, plan) == (90, 1, (13, 7))


def test_a_plan_the_prior_is_far_off_for_is_certified_alone_then():
    """No plan with accumulation fits (each adds 2000 bytes): four divisors tried, then the rung certified alone as
    without accumulation, and no plan chosen."""
    search = CertifyingSearch(with_accumulation(fake_peak, grads=2000), LIMIT, {FP32: prior()})
    result = search.run([FP32], 256, 64, 64)
    tried = [(t.point.micro_batch_size, t.point.grad_accum_steps, t.stage) for t in search.trials]
    assert tried[:6] == [(64, 4, "prior"), (32, 8, "corrected"), (16, 16, "corrected"), (8, 32, "corrected"),
                         (90, 1, "prior"), (91, 1, "verify")]
    assert result.rungs[0].micro_batch_size == 90 and result.choice is None


def test_the_throughput_objective_certifies_the_rung_alone():
    """Rungs are compared by their speed without accumulation there: b_S, then the plan's verify."""
    rung, tried, plan = climb(fake_peak, prior(), objective="throughput")
    assert tried == [(90, 1, "prior", "fits"), (91, 1, "verify", "over-headroom"), (64, 4, "verify", "fits")]
    assert (rung.micro_batch_size, rung.grad_accum_steps, plan) == (90, 1, (64, 4))


def test_the_prior_of_the_rung_the_estimate_chose_carries_its_plan():
    """priors_from: each rung's context, largest micro-batch and peaks, and the chosen rung's plan micro-batch (the
    estimate verified it with accumulation, so the device starts from it)."""
    fp16 = Rung("fp16", "fp16", False)
    estimate = LadderSearch(with_accumulation(fake_peak), LIMIT).run([FP32, fp16], 256, 64, 64)
    priors = priors_from(estimate)
    p = priors[FP32]
    assert (p.context_length, p.micro_batch_size, p.plan_micro_batch, p.chosen) == (64, 90, 64, True)
    assert dict(p.peaks)[90] == fake_peak(90)
    q = priors[fp16]  # the same plan on the next rung: the tie goes to the earlier rung
    assert (q.micro_batch_size, q.plan_micro_batch, q.chosen) == (90, None, False)
