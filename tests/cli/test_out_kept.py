"""A plan a probe measured is not replaced by an estimate, and a budget without its unit is named as such: one line,
exit 2, nothing overwritten. devices: cpu (probe), fake (estimate)."""

from __future__ import annotations

import pytest

from ..conftest import one_line_error, run_cli

ESTIMATE = ("--budget", "400KiB", "--margin", "0")  # the tiny model's ladder on the fake device: a second or two


def test_an_estimate_does_not_replace_the_plan_a_probe_measured(write_model, tmp_path):
    """device: cpu, then fake. `estimate` writes best.yaml too by default: after a probe (device time, on a GPU)
    it would have replaced the measured plan with a predicted one; an estimate's own config it replaces."""
    model, out = write_model(), tmp_path / "best.yaml"
    probe = ("probe", model, "--device", "cpu", "--budget", "4MiB", "--batch", "2", "--context", "4", "--out", out)
    assert run_cli(*probe).exit_code == 0
    measured = out.read_text()
    r = run_cli("estimate", model, *ESTIMATE, "--batch", "2", "--context", "4", "--out", out)
    one_line_error(r, f"--out {out} holds a plan measured by probe on cpu (simulated memory, budget 4.00 MiB), ",
                   "not replacing it with an estimate; choose another --out (e.g. --out estimate.yaml)")
    assert out.read_text() == measured
    estimated = tmp_path / "estimate.yaml"
    for _ in range(2):  # the second replaces the first's
        r = run_cli("estimate", model, *ESTIMATE, "--batch", "2", "--context", "4", "--out", estimated)
        assert r.exit_code == 0, r.output


@pytest.mark.parametrize("args", [("--budget", "24"), ("--gpu", "t4", "--budget", "16"), ("--budget", "0.5")])
def test_a_budget_without_its_unit_is_one_line_naming_the_units(args, write_model):
    """`--budget 24` meant 24 GB: a bare number is bytes, and one below 1 KiB holds no model."""
    value = args[-1]
    one_line_error(run_cli("estimate", write_model(), *args), f"budget {value!r}: a number without a unit is bytes",
                   f"({value}GiB, {value}GB or {value}MiB)")
