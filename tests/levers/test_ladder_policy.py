"""The ladder's policy past accumulation: torch-free against fake memory functions (exact sequences), then the
probe on the cpu device and --levers through the CLI."""

from __future__ import annotations

import json

import pytest

from oomtune.config.loading import load_config
from oomtune.search.ladder import LadderSearch, Measurement, Point, Rung

from ..conftest import EXAMPLES, run_cli

FP32, AMP, CKPT = Rung("fp32", "fp32", False), Rung("amp", "bf16", False), Rung("checkpointing", "bf16", True)
TRUE = Rung("bf16-true", "bf16-true", True)
EIGHT = Rung("bf16-true+8bit", "bf16-true", True, optimizer_8bit=True)
OFFLOAD = Rung("bf16-true+8bit+offload", "bf16-true", True, optimizer_8bit=True, offload_optimizer=True)
FLOOR = {FP32: 1700, AMP: 1700, CKPT: 1750, TRUE: 800, EIGHT: 500, OFFLOAD: 200}  # weights, grads, state
PER_TOKEN = {FP32: 4, AMP: 2, CKPT: 1, TRUE: 1, EIGHT: 1, OFFLOAD: 1}
LIMIT, BUDGET = 1800, 2000


def measure(p: Point) -> Measurement:
    peak = FLOOR[p.rung] + PER_TOKEN[p.rung] * p.micro_batch_size * p.context_length // 8 + 10 * p.grad_accum_steps
    return Measurement(oom=True) if peak > BUDGET else Measurement(oom=False, peak_bytes=peak)


def test_the_rungs_past_accumulation_are_climbed_only_where_the_others_cannot_reach_the_context():
    s = LadderSearch(measure, LIMIT)
    r = s.run([FP32, AMP, CKPT], batch=64, context=512, min_context=64, past=[TRUE, EIGHT, OFFLOAD])
    names = [x.rung.name for x in r.rungs]
    assert names == ["fp32", "amp", "checkpointing", "bf16-true"]  # bf16-true reaches 512: the climb ends there
    assert all(x.context_length is None or x.context_length < 512 for x in r.rungs[:3])
    assert r.rungs[-1].context_length == 512 and r.choice.rung == TRUE
    assert r.choice.micro_batch_size * r.choice.grad_accum_steps == 64  # the global batch kept

    easy = LadderSearch(measure, LIMIT)  # a plan the usual rungs fit (fp32 2 x 2): no rung past accumulation
    r = easy.run([FP32, AMP, CKPT], batch=4, context=64, min_context=64, past=[TRUE, EIGHT, OFFLOAD])
    assert all(t.point.rung in (FP32, AMP, CKPT) for t in easy.trials) and r.choice.context_length == 64
    # at batch 64 they fit a micro-batch at 64 alone, but no accumulated plan (10 bytes a micro-step here): the
    # climb goes on to bf16-true, whose plan fits (it used to stop, with nothing found)
    hard = LadderSearch(measure, LIMIT).run([FP32, AMP, CKPT], batch=64, context=64, min_context=64,
                                            past=[TRUE, EIGHT, OFFLOAD])
    assert hard.rungs[0].micro_batch_size >= 1 and hard.choice.rung == TRUE


def test_without_accumulation_a_plan_must_fit_the_whole_batch():
    s = LadderSearch(measure, LIMIT)  # bf16-true fits micro-batch 4 at 512 (1066 bytes), not 64
    r = s.run([FP32, AMP, CKPT], batch=64, context=512, min_context=512, past=[TRUE, EIGHT, OFFLOAD],
              accumulation=False)
    assert r.choice is None and all(t.point.grad_accum_steps == 1 for t in s.trials)
    with_accumulation = LadderSearch(measure, LIMIT).run([FP32, AMP, CKPT], batch=64, context=512, min_context=512,
                                                         past=[TRUE, EIGHT, OFFLOAD])
    assert with_accumulation.choice.grad_accum_steps > 1  # the same search with accumulation finds one
    small = LadderSearch(measure, LIMIT).run([FP32, AMP, CKPT], batch=4, context=512, min_context=512,
                                             past=[TRUE, EIGHT, OFFLOAD], accumulation=False)
    assert (small.choice.rung, small.choice.micro_batch_size, small.choice.grad_accum_steps) == (TRUE, 4, 1)
    # without accumulation the climb goes on while no rung fits the whole batch: bf16-true fits 15 of 16 at 512
    # (800 + 64 x 15 + 10 = 1770), +8bit all 16 (500 + 1024 + 10); the climb used to end at bf16-true, with none
    sixteen = LadderSearch(measure, LIMIT).run([FP32, AMP, CKPT], batch=16, context=512, min_context=512,
                                               past=[TRUE, EIGHT, OFFLOAD], accumulation=False)
    assert [r.rung for r in sixteen.rungs] == [FP32, AMP, CKPT, TRUE, EIGHT]
    assert (sixteen.choice.rung, sixteen.choice.micro_batch_size, sixteen.choice.grad_accum_steps) == (EIGHT, 16, 1)


def test_without_accumulation_in_levers_nothing_fits_says_so(tmp_path):
    """device: cpu. Without accumulation the whole batch must fit at once; where it does not, the reason names
    the lever left out and the batch that would fit (it said accumulation was tried and no accumulated plan fit)."""
    r = run_cli("probe", EXAMPLES / "tiny_gpt.py", "--device", "cpu", "--budget", "12MiB", "--batch", "32",
                "--context", "64", "--levers", "amp,checkpointing", "--out", tmp_path / "x.yaml")
    assert r.exit_code == 1, r.output
    assert "(accumulation is not in --levers): at most micro-batch " in r.stderr, r.stderr
    assert "Add accumulation to --levers, or lower --batch to" in r.stderr and "accumulated plan" not in r.stderr


def test_estimate_without_accumulation_says_the_batch_not_micro_batch_1_is_what_does_not_fit(tmp_path):
    """device: fake. The estimate explained every nothing-fits by the smallest plan: "even micro-batch 1 ... peaks
    at 2.10 MiB > 4.50 MiB allowed", false, where micro-batch 2 fitted and the whole batch (accumulation left out of
    --levers) was what did not."""
    r = run_cli("estimate", EXAMPLES / "tiny_gpt.py", "--budget", "12MiB", "--margin", "0", "--batch", "32",
                "--context", "64", "--levers", "amp,checkpointing", "--out", tmp_path / "x.yaml")
    assert r.exit_code == 1, r.output
    assert "(accumulation is not in --levers): at most micro-batch " in r.stderr, r.stderr
    assert "even micro-batch 1" not in r.stderr and "what would help" not in r.output


def test_probe_climbs_past_accumulation_where_fp32_state_alone_is_over_the_budget(tmp_path):
    """device: cpu. The tiny GPT's fp32 weights + gradients + AdamW state (fused: no step temporaries) are 4.11 MiB:
    4 MiB (3.6 allowed) cannot hold them on any usual rung, which are climbed past without a trial (each would run
    out of memory), with a note; bf16-true halves them. Searched with those rungs tried, the same plan."""
    out = tmp_path / "low.yaml"
    r = run_cli("probe", EXAMPLES / "tiny_gpt.py", "--device", "cpu", "--budget", "4MiB", "--batch", "8",
                "--context", "64", "--out", out, "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert [x["rung"] for x in report["rungs"]] == ["fp32", "amp", "checkpointing", "step-in-backward", "bf16-true"]
    assert [t["rung"] for t in report["trials"]][:1] == ["step-in-backward"]  # the whole batch: one trial, over
    assert {t["rung"] for t in report["trials"]} == {"step-in-backward", "bf16-true"}
    assert any("not tried on the fp32, amp, checkpointing rungs" in n for n in report["notes"]), report["notes"]
    with pytest.MonkeyPatch.context() as mp:  # every rung tried: each of their trials runs out of memory
        mp.setattr("oomtune.search.probe.out_of_reach", lambda *a: (frozenset(), ()))
        tried = json.loads(run_cli("probe", EXAMPLES / "tiny_gpt.py", "--device", "cpu", "--budget", "4MiB", "--batch",
                                   "8", "--context", "64", "--out", tmp_path / "tried.yaml", "--json").stdout)
    assert {t["rung"] for t in tried["trials"]} == {"fp32", "amp", "checkpointing", "step-in-backward", "bf16-true"}
    assert all(t["result"] == "oom" for t in tried["trials"] if t["rung"] in ("fp32", "amp", "checkpointing"))
    assert load_config(tmp_path / "tried.yaml").plan == load_config(out).plan
    plan = load_config(out).plan
    assert (plan.precision, plan.global_batch_size) == ("bf16-true", 8)
    check = run_cli("check", "--config", out)  # re-measured on the fake device: the same plan still fits
    assert check.exit_code == 0, check.output
    assert "nf4" in report["levers_not_used"] and "frozen" in report["levers_not_used"]["nf4"]

    classic = run_cli("probe", EXAMPLES / "tiny_gpt.py", "--device", "cpu", "--budget", "4MiB", "--levers",
                      "amp,checkpointing,accumulation", "--out", tmp_path / "classic.yaml")
    assert classic.exit_code == 2 and "too small for the weights alone" in classic.stderr
    bad = run_cli("probe", EXAMPLES / "tiny_gpt.py", "--levers", "amp,8-bit", "--out", tmp_path / "x.yaml")
    assert bad.exit_code == 2 and "--levers 'amp,8-bit': unknown 8-bit" in bad.stderr


def test_a_missing_library_skips_its_rung_with_a_note_and_a_config_that_needs_it_is_one_line(tmp_path, monkeypatch,
                                                                                          write_model):
    """device: cpu. As if torchao were not installed: the LoRA-like model's NF4 rung is left out with a note naming
    the extra, and a config asking for NF4 weights stops with one line and exit 2 before any file is written."""
    import oomtune.levers as levers

    monkeypatch.setattr(levers, "installed", lambda name: name != "torchao")
    assert levers.missing_library("nf4_frozen_weights", "cpu") == \
        "NF4 frozen weights need torchao (pip install 'oomtune[finetune]')"
    assert levers.missing_library("optimizer_8bit", "cpu") is None  # the cpu device's own stand-in
    model = write_model(FROZEN_MODEL)
    r = run_cli("probe", model, "--device", "cpu", "--budget", "3MiB", "--context", "1", "--batch", "8",
                "--out", tmp_path / "p.yaml", "--json")
    report = json.loads(r.stdout)
    assert report["levers_not_used"]["nf4"] == "NF4 frozen weights need torchao (pip install 'oomtune[finetune]')"
    assert "nf4" not in " ".join(x["rung"] for x in report["rungs"])
    # printed where the climb went past accumulation, the extra's brackets are text, not rich markup
    text = run_cli("probe", model, "--device", "cpu", "--budget", "300KiB", "--context", "1", "--batch", "8",
                   "--out", tmp_path / "p.yaml")
    assert text.exit_code == 0 and "bf16-true" in text.stdout, text.output
    assert "NF4 frozen weights need torchao (pip install 'oomtune[finetune]')" in " ".join(text.stdout.split())
    named = run_cli("probe", model, "--device", "cpu", "--budget", "200KiB", "--context", "1", "--batch", "8",
                    "--levers", "nf4,accumulation", "--out", tmp_path / "p.yaml")  # the lever asked for, unusable
    assert named.exit_code == 2 and "too small for the weights alone" in named.stderr
    assert "(no nf4 rung: NF4 frozen weights need torchao" in " ".join(named.stderr.split()), named.stderr
    cfg = tmp_path / "nf4.yaml"
    cfg.write_text(f"model: {model}\nplan:\n  micro_batch_size: 2\n  context_length: 1\n  nf4_frozen_weights: true\n")
    t = run_cli("train", "--config", cfg, "--device", "cpu", "--steps", "2", "--run-dir", tmp_path / "run")
    assert t.exit_code == 2 and t.stderr.strip().splitlines()[-1] == (
        "error: plan.nf4_frozen_weights: NF4 frozen weights need torchao (pip install 'oomtune[finetune]')")
    assert not (tmp_path / "run").exists()


def test_a_model_files_own_optimizer_is_kept_and_the_8bit_and_offload_rungs_say_why_they_are_left_out(tmp_path,
                                                                                                   write_model):
    """SGD keeps no moments (no 8bit rung; offload rebuilds it on the host: tests/levers/test_own_optimizer.py); a
    class the levers cannot rebuild (a subclass of AdamW) keeps both out, named."""
    model = write_model(FROZEN_MODEL + "\ndef optimizer(params, lr):\n    return torch.optim.SGD(params, lr=lr)\n")
    r = run_cli("probe", model, "--device", "cpu", "--budget", "3MiB", "--context", "1", "--batch", "8",
                "--out", tmp_path / "p.yaml", "--json")
    why = json.loads(r.stdout)["levers_not_used"]
    assert why["8bit"] == ("model.py's optimizer() returns torch.optim.SGD, which keeps no moments for 8-bit AdamW "
                           "to store") and "offload" not in why
    # the breakdown names that optimizer's state, not AdamW's (device: fake)
    for extra in (("--batch", "8", "--out", tmp_path / "e.yaml"), ("--micro-batch", "2")):  # the estimate's plan,
        est = run_cli("estimate", model, "--budget", "64MiB", "--margin", "0", "--context", "1", *extra)  # one plan
        assert est.exit_code == 0 and "AdamW" not in est.stdout, est.output
        assert "SGD's state" in est.stdout, est.stdout  # (the what-if said "your optimizer()'s state")
    # a what-if that does not fit says why 8-bit and offload cannot apply (it offered them as "enough")
    from oomtune.api import what_if

    adamw = write_model(FROZEN_MODEL + "\nclass Tuned(torch.optim.AdamW):\n    pass\n\ndef optimizer(params, lr):\n"
                        "    return Tuned(params, lr=lr)\n", name="adamw.py")
    peak = what_if(adamw, 64, context=1, margin="0").breakdown.peak_bytes
    advice = what_if(adamw, 64, context=1, budget=f"{peak}B", margin="0").levers  # (90% of it is allowed)
    said = [line for line in advice if "--levers 8bit" in line or "--levers offload)" in line]
    assert len(said) == 2 and all(line.endswith("; the ladder could not use it: adamw.py's optimizer() returns "
                                                "Tuned, which this lever cannot rebuild (it keeps the param groups of "
                                                "torch's AdamW, Adam and SGD)") for line in said)


# weights, gradients and AdamW state of 2 x 128 x 128 fp32 weights: 1 MiB; half of them frozen (NF4's target)
FROZEN_MODEL = """
import torch
from torch import nn

def build_model():
    model = nn.Sequential(nn.Linear(128, 128, bias=False), nn.Linear(128, 128, bias=False))
    model[0].weight.requires_grad_(False)
    return model

def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, 128, device=device), torch.randn(batch_size, 128, device=device)

def loss(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()
"""


def test_a_card_without_bf16_offloads_in_fp32(tmp_path):
    """device: fake, a T4 profile (no bf16: amp is fp16, with a GradScaler, which cannot unscale gradients offload
    has moved off the device). In 3 MiB micro-batch 1 fits on no rung up to fp16 + 8-bit; the offload rungs run in
    fp32, and the first of them fits (before, offload was left out on such a card and nothing fitted)."""
    out = tmp_path / "t4.yaml"
    r = run_cli("estimate", EXAMPLES / "tiny_gpt.py", "--gpu", "t4", "--budget", "3MiB", "--margin", "0", "--batch",
                "8", "--context", "64", "--out", out, "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert [x["rung"] for x in report["rungs"]] == ["fp32", "amp", "checkpointing", "8bit", "fp32+8bit+offload"]
    assert "offload" not in report["levers_not_used"] and "no native bf16" in report["levers_not_used"]["bf16-true"]
    plan = load_config(out).plan
    assert (plan.precision, plan.optimizer_8bit, plan.offload_optimizer) == ("fp32", True, True)
    assert plan.activation_checkpointing and plan.global_batch_size == 8


def test_levers_none_is_the_fp32_rung_alone_and_an_empty_list_is_refused():
    """device: none. An empty --levers is a script's unset variable more often than a choice: it is refused, and
    `none` says the same thing on purpose."""
    from oomtune.errors import OomtuneError
    from oomtune.search.options import LEVERS, parse_levers

    assert parse_levers("none") == frozenset() and parse_levers(None) == frozenset(LEVERS)
    assert parse_levers(" amp, accumulation ") == {"amp", "accumulation"}
    for empty in ("", " , "):
        with pytest.raises(OomtuneError, match="names no lever"):
            parse_levers(empty)


def test_the_climb_goes_on_where_micro_batch_1_fits_alone_but_no_accumulated_plan_does():
    """Accumulation keeps every gradient alive through the next micro-step: bf16-true fits micro-batch 1 at 512
    alone (800 + 64 + 10 = 874) but not 1 x 64 with its gradients held (+ 1000 here); the climb used to end at
    bf16-true and say nothing fits, where +8bit (whose gradients this model holds at 200) fits the plan."""
    held = {TRUE: 1000, EIGHT: 200}

    def measure_accumulating(p: Point) -> Measurement:
        m = measure(p)
        extra = held.get(p.rung, 0) if p.grad_accum_steps > 1 else 0
        if m.oom or m.peak_bytes + extra > BUDGET:
            return Measurement(oom=True)
        return Measurement(oom=False, peak_bytes=m.peak_bytes + extra)

    s = LadderSearch(measure_accumulating, LIMIT)
    r = s.run([FP32, AMP, CKPT], batch=64, context=512, min_context=512, past=[TRUE, EIGHT, OFFLOAD])
    assert [x.rung for x in r.rungs] == [FP32, AMP, CKPT, TRUE, EIGHT]
    assert r.rungs[3].context_length == 512 and r.rungs[3].micro_batch_size >= 1  # fits alone, not accumulated
    assert r.choice.rung == EIGHT and r.choice.micro_batch_size * r.choice.grad_accum_steps == 64
    assert not any(t.point.rung == OFFLOAD for t in s.trials)  # +8bit's plan fits: the climb ends there


# a LoRA-like model: a frozen 256 x 256 base (whole NF4 blocks), trained adapters of 256 x 4 and a 256 x 4 head:
# every trained tensor is under 4096 elements, for which 8-bit AdamW keeps plain moments (as AdamW does)
LORA_LIKE = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(256, 256, bias=False)
        self.base.weight.requires_grad_(False)
        self.a = nn.Linear(256, 4, bias=False)
        self.b = nn.Linear(4, 256, bias=False)
        self.out = nn.Linear(256, 4)

    def forward(self, x, y):
        x = self.base(x) + self.b(self.a(x))
        return nn.functional.cross_entropy(self.out(x).mean(1), y)

def build_model():
    return Net()

def make_batch(batch_size, context_length, device):
    return (torch.randn(batch_size, context_length, 256, device=device),
            torch.randint(0, 4, (batch_size,), device=device))
"""


def test_8bit_is_left_out_where_it_would_not_shrink_the_state_and_its_estimate_is_the_levers(write_model, tmp_path):
    """device: fake. The formula (StaticMemory.moment_bytes) against the lever's measured state, on a model that
    quantizes (tiny_gpt) and on one that does not: within the allocator's 512-byte rounding of small tensors."""
    from oomtune.config.schema import Plan
    from oomtune.memory.breakdown import static_memory
    from oomtune.model_file import load_model_file

    lora = write_model(LORA_LIKE)
    for path in (lora, EXAMPLES / "tiny_gpt.py"):
        mf = load_model_file(path)
        for precision in ("bf16-true", "bf16"):  # plain moments in the parameter's dtype: bf16, then fp32
            formula = static_memory(mf).moment_bytes(precision, eight_bit=True)
            measured = static_memory(mf, Plan(1, 8, precision, optimizer_8bit=True), "8bit").optimizer_bytes
            assert formula == measured, (path, precision)
    r = run_cli("estimate", lora, "--budget", "1MiB", "--margin", "0", "--batch", "4", "--context", "16",
                "--out", tmp_path / "best.yaml", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["levers_not_used"]["8bit"].startswith("8-bit AdamW keeps plain moments for tensors under 4096 "
                                                      "elements (or not a multiple of 256), and all 3,076 trained")
    assert not any("8bit" in x["rung"] for x in data["rungs"])
