"""Nothing fits only because of the headroom: the plan that ran under the budget but over the limit the headroom
leaves is named, with its peak, the budget, the limit and the --headroom that would admit it (search/headroom_note.py),
in the reason and in --json. Before, the reason named only a larger budget or a smaller model."""

from __future__ import annotations

import json

import pytest

from oomtune.search.headroom_note import admitting, over_headroom

from ..conftest import run_cli

# Tiny weights, activations that grow with the context: micro-batch 1 at context 2048 is most of the peak.
ACTIVATIONS = '''
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x.square().mean()

def build_model():
    return Net()

def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, context_length, 64, device=device)

DEFAULTS = {"batch": 4, "context": 2048}
'''


def search(command: str, model, *args: str) -> tuple[int, dict]:
    device = ("--device", "cpu") if command == "probe" else ("--margin", "0")
    r = run_cli(command, model, *device, "--levers", "none", "--out", f"{command}.yaml", "--json", *args)
    return r.exit_code, json.loads(r.stdout)


@pytest.mark.parametrize("command", ["probe", "estimate"])
def test_a_plan_refused_only_by_the_headroom_names_the_headroom_that_admits_it(write_model, command):
    """device: cpu (probe's trials) and fake (estimate's smallest plan). The budget is the peak of micro-batch 1 over
    0.95: under the budget, over 0.9 of it; 0.04 (the largest whole percent under 5%) admits it, 0.05 would not."""
    model = write_model(ACTIVATIONS)
    code, found = search(command, model, "--budget", "1GiB", "--batch", "1")
    assert code == 0
    peak = found["peak_bytes"]
    budget = peak * 100 // 95
    code, report = search(command, model, "--budget", str(budget))
    assert code == 1 and report["fits"] is False
    assert report["over_headroom"] == {"plan": "micro-batch 1, context 2048, fp32", "peak_bytes": peak,
                                       "budget_bytes": budget, "limit_bytes": int(budget * 0.9), "headroom": 0.1,
                                       "admitting_headroom": 0.04}
    assert "Only the headroom refuses micro-batch 1, context 2048, fp32: it peaks at " in report["why_nothing_fits"]
    assert "; --headroom 0.04 would admit it, leaving less room for what the trials did not see" \
        in report["why_nothing_fits"]
    code, admitted = search(command, model, "--budget", str(budget), "--headroom", "0.04", "--batch", "1")
    assert code == 0 and admitted["peak_bytes"] == peak and admitted["over_headroom"] is None


def test_a_budget_that_holds_the_weights_but_not_with_its_headroom_says_so(write_model):
    """device: cpu. The weights, gradients and AdamW state (268 KiB) under the budget, over the limit: exit 2 as
    before, now naming the headroom that leaves room for them."""
    model = write_model(ACTIVATIONS)
    r = run_cli("probe", model, "--device", "cpu", "--budget", "290KiB", "--levers", "none")
    assert r.exit_code == 2
    assert r.stderr.strip().splitlines()[-1].endswith(
        "= 268.00 KiB; it is under the budget itself: --headroom 0.07 would leave room for it, if not yet for the "
        "activations")


def test_the_admitting_headroom_is_the_largest_round_one_whose_limit_holds_the_peak():
    assert admitting(95, 100) == 0.05 and admitting(951, 1000) == 0.04
    assert admitting(9_995, 10_000) == 0.0  # 0.05%: neither a whole percent nor a tenth of one
    assert admitting(996, 1000) == 0.004
    assert over_headroom([("a", 95), ("b", 92), ("c", None), ("d", 101), ("e", 90)], 100, 0.1).plan == "b"
    assert over_headroom([("d", 101), ("e", 90)], 100, 0.1) is None  # an OOM and a fit: no headroom refused them
