"""The prior pays or is skipped (search/prior.py, device_trials.py): with prior="auto" (the default on cuda), the
probe times one trial on its device and the same plan on fake tensors, and runs the estimate only where its fake
trials cost less than the device trials they save; else it searches alone and found_by.prior says why.

device: cpu (the auto mode is the default on cuda only; on cpu the API's prior="auto" asks for it), a tiny model
whose step costs next to nothing on the cpu, and one that multiplies matrices on real tensors (seconds on the
cpu, milliseconds on fake tensors)."""

from __future__ import annotations

import pytest

import oomtune
from oomtune.errors import OomtuneError
from oomtune.search.prior import device_trials_saved, why_it_would_not_pay

from ..conftest import TINY_MODEL

# A step the cpu takes seconds over and fake tensors do not: matrix products of a tensor the loss does not need
DEAR = TINY_MODEL.replace("    def forward(self, x, y):\n", """    def forward(self, x, y):
        z = torch.ones(1024, 1024, device=x.device)
        with torch.no_grad():
            for _ in range(48):
                z = z @ z / 1024
""")


def test_the_rule_weighs_three_fake_trials_a_rung_against_the_bisection_it_saves():
    assert device_trials_saved(64) == 4 and device_trials_saved(16) == 2 and device_trials_saved(2) == 1
    assert why_it_would_not_pay(device_seconds=1.0, fake_seconds=0.3, batch=64) is None  # 0.9 s against 4 s
    why = why_it_would_not_pay(device_seconds=0.37, fake_seconds=2.3, batch=32)  # the H200's GPT-2 small
    assert why == ("it would not pay: a trial on fake tensors took 2.30 s against 0.37 s on the device, and the "
                   "estimate's ~3 fake trials a rung would cost more than the ~3 device trials a rung it saves "
                   "(--prior runs it anyway)")


def test_a_cheap_device_step_skips_the_prior_and_the_timed_trial_is_the_searchs_own(write_model, tmp_path):
    model = write_model()
    alone = oomtune.probe(model, batch=16, context=8, device="cpu", budget="200KiB", prior=False)
    auto = oomtune.probe(model, batch=16, context=8, device="cpu", budget="200KiB", prior="auto",
                         out=tmp_path / "best.yaml")
    assert auto.config.found_by.prior.startswith("searched without a prior: it would not pay: a trial on fake "
                                                 "tensors took ")
    assert auto.prior.missing is not None and auto.prior.trials == 0
    # the same search, trial for trial: the timed trial (micro-batch 1 at the target context) was not run twice
    key = [(t.rung, t.stage, t.micro_batch_size, t.result) for t in alone.records]
    assert [(t.rung, t.stage, t.micro_batch_size, t.result) for t in auto.records] == key
    assert auto.config.plan == alone.config.plan
    assert "it would not pay" in (tmp_path / "best.yaml").read_text()


def test_a_dear_device_step_runs_the_prior(write_model):
    """48 products of 1024x1024 matrices a forward: seconds a trial on the cpu, and on fake tensors what any trial
    costs there (they only allocate)."""
    auto = oomtune.probe(write_model(DEAR), batch=64, context=256, device="cpu", budget="16MiB", prior="auto")
    assert auto.prior.missing is None and auto.prior.trials > 0
    assert auto.config.found_by.prior.startswith("certified from an estimate on fake tensors")


def test_prior_takes_only_its_four_values(write_model):
    with pytest.raises(OomtuneError, match="prior must be True, False, None or 'auto', got 'sometimes'"):
        oomtune.probe(write_model(), batch=4, context=8, device="cpu", budget="1MiB", prior="sometimes")
