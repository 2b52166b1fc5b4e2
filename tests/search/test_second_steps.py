"""A trial's second step made from its first (memory/second_step.py, search/second_steps.py): where the check agrees,
the made trial's figures equal the trial that ran both steps, to the byte (peaks, phases, the caching allocator
model's reserved bytes, host memory, the trace itself); where it does not, both steps run. Device: fake (the
estimate's never-out twin with a card's rules, which traces)."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest

from oomtune.config.schema import Plan
from oomtune.dist.group import LOCAL
from oomtune.memory.breakdown import recorded_trial
from oomtune.memory.cards import find_gpu
from oomtune.memory.devices import FakeDevice
from oomtune.memory.life_kinds import peak_parts
from oomtune.memory.made_peak import made_kinds
from oomtune.memory.replay import Trace
from oomtune.memory.second_step import repeat_step, with_second_step
from oomtune.model_file import load_model_file
from oomtune.search.second_steps import SecondSteps
from oomtune.search.trial import run_trial

from ..conftest import EXAMPLES, run_cli
from .test_block_extrapolation import MODELS, _deeper

FIGURES = ("peak_bytes", "peak_allocated_bytes", "batch_peak_bytes", "phase_peaks", "modelled_reserved_bytes",
           "host_peak_bytes", "trace")
CKPT = Plan(2, 32, "bf16", activation_checkpointing=True)
CASES = [  # (model, plan)
    (EXAMPLES / "tiny_gpt.py", Plan(2, 32, "fp32")),
    (EXAMPLES / "tiny_gpt.py", Plan(3, 32, "bf16", activation_checkpointing=True, offload_activations=True)),
    (MODELS / "hf_llama_lora.py", dataclasses.replace(CKPT, optimizer_8bit=True)),
    (MODELS / "hf_llama_lora.py", dataclasses.replace(CKPT, precision="bf16-true", offload_optimizer=True)),
    ("wide", Plan(1, 64, "bf16-true", activation_checkpointing=True, optimizer_8bit=True, nf4_frozen_weights=True)),
    (MODELS / "hf_t5.py", Plan(2, 32, "fp32")),
    (MODELS / "hf_mixtral_lora.py", CKPT),
    (MODELS / "compiled.py", Plan(2, 32, "bf16")),
    (MODELS / "llama3_scaled_rope.py", CKPT),
    (MODELS / "hf_llama_lora.py", dataclasses.replace(CKPT, grad_accum_steps=2, global_batch_size=4)),
    (MODELS / "hf_llama_lora.py", Plan(2, 32, "bf16-true", activation_checkpointing=True, grad_accum_steps=3,
                                       global_batch_size=6, chunked_loss=True, offload_optimizer=True)),
]


def _twin() -> FakeDevice:
    return FakeDevice("80GiB", gpu=find_gpu("a100-80"), never_runs_out=True, traces=True)


def _id(case) -> str | None:
    return case if isinstance(case, str) else getattr(case, "stem", None)


def _recorded(mf, plan: Plan, device: FakeDevice, second: SecondSteps | None = None) -> tuple:
    return recorded_trial(mf, plan, device, 2, LOCAL, functools.partial(run_trial, second=second))


@pytest.mark.parametrize(("source", "plan"), CASES, ids=_id)
def test_the_made_second_step_gives_the_figures_of_both_steps_run(tmp_path, source, plan):
    """device: fake. Three trials of one plan, each recorded for its breakdown: both steps run without the lever,
    both run and checked, then one run and the second made; the first and last agree on every figure, and on the
    breakdown of the peak (each life of the made step sorted as the first step's life it repeats)."""
    path = _deeper(tmp_path, MODELS / "hf_llama_lora.py", 2, wide=True) if source == "wide" else source
    mf = load_model_file(path)
    whole, whole_bd = _recorded(mf, plan, _twin())
    second, device = SecondSteps(), _twin()
    checked, _ = _recorded(mf, plan, device, second)
    assert list(second.agreed.values()) == [True] and not checked.second_step_made
    made, made_bd = _recorded(mf, plan, device, second)
    assert made.second_step_made and second.made == 1
    for figure in FIGURES:
        assert getattr(made, figure) == getattr(whole, figure), figure
        assert getattr(checked, figure) == getattr(whole, figure), figure
    assert made_bd == whole_bd and whole_bd is not None


@pytest.mark.parametrize("source", [EXAMPLES / "tiny_gpt.py", MODELS / "hf_llama_lora.py"], ids=_id)
def test_a_check_without_checkpointing_makes_the_checkpointed_second_step(source):
    """device: fake. The ladder's checkpointing rung has the levers of the rung before it, plus checkpointing: the
    check made there holds (checkpointing and activation offloading change when a step's activations live, not
    what outlives the step), and its made trial's figures and breakdown equal both steps run."""
    mf = load_model_file(source)
    plain, offloaded = Plan(2, 32, "bf16"), dataclasses.replace(CKPT, offload_activations=True)
    for checked, others in ((plain, (CKPT, offloaded)), (offloaded, (plain,))):  # (and the other way round)
        second, device = SecondSteps(), _twin()
        _recorded(mf, checked, device, second)
        assert list(second.agreed.values()) == [True]
        for plan in others:
            made, made_bd = _recorded(mf, plan, device, second)
            whole, whole_bd = _recorded(mf, plan, _twin())
            assert made.second_step_made
            for figure in FIGURES:
                assert getattr(made, figure) == getattr(whole, figure), figure
            assert made_bd == whole_bd and whole_bd is not None


def test_where_the_second_step_differs_both_steps_run():
    """device: fake. AdaLoRA's rank allocator makes its scores in the first step's optimizer phase and keeps
    changing its storages after: the made step would differ from the run one, so the check says no and later
    trials of the plan run both steps."""
    mf = load_model_file(MODELS / "hf_llama_adalora.py")
    second, device = SecondSteps(), _twin()
    run_trial(mf, Plan(2, 32, "fp32"), device, second=second)
    assert list(second.agreed.values()) == [False]
    again = run_trial(mf, Plan(3, 32, "fp32"), device, second=second)
    assert not again.second_step_made and second.made == 0
    assert second.mode(Plan(2, 64, "fp32", grad_accum_steps=2, global_batch_size=4), device, 2, 1) is None  # (its
    # levers were checked: at any context and accumulation)
    assert second.mode(Plan(2, 64, "bf16", grad_accum_steps=2, global_batch_size=4), device, 2, 1) == "check"
    second.whole = True  # (made_steps=False; an answer whose made peak could not be sorted)
    assert second.mode(Plan(2, 32, "bf16"), device, 2, 1) is None


def test_the_made_step_keeps_what_outlives_the_first_and_makes_the_loss_again():
    """No torch: a first step that makes activations (a, freed), a loss (L, held), state in the optimizer phase (S,
    kept), and frees a storage from before it (P). The second makes a and L again, frees the first L where the step
    returns, keeps S, and frees P no more; what follows frees the second's loss."""
    events = [("set", "P", 8), ("mark", "forward"), ("set", "a", 100), ("set", "L", 4), ("mark", "optimizer"),
              ("set", "S", 50), ("free", "a"), ("free", "P"), ("free", "L"), ("free", "S"), ("mark", None)]
    start, returned, end = 1, 8, 8  # (the trial lets go of L and S after its steps: the events from index 8)
    second, again = repeat_step(events, set(), start, returned, end, "L")
    assert again == {"L": ("2", 2)}
    assert second == [("mark", "forward"), ("set", ("2", 1), 100), ("set", ("2", 2), 4), ("mark", "optimizer"),
                      ("free", ("2", 1)), ("free", "L")]
    made = with_second_step(events, set(), (start, returned, end), "L")
    assert made[-3:] == [("free", ("2", 2)), ("free", "S"), ("mark", None)]


def test_the_estimate_with_made_second_steps_answers_as_with_both_steps_run(tmp_path, monkeypatch):
    """device: fake, a card's rules (T4). The tiny GPT's whole ladder: the same plan, peak and breakdown, and the
    same figures for every trial, as with every trial's two steps run."""
    args = ["estimate", EXAMPLES / "tiny_gpt.py", "--gpu", "t4", "--budget", "700MiB", "--batch", "64", "--context",
            "256", "--json"]
    made = json.loads(run_cli(*args, "--out", tmp_path / "made.yaml").stdout)
    monkeypatch.setattr(SecondSteps, "mode", lambda *a: None)
    run = json.loads(run_cli(*args, "--out", tmp_path / "run.yaml").stdout)
    assert made["plan"] == run["plan"] and made["breakdown"] == run["breakdown"]
    sources = [t["source"] for t in made["trials"]]
    assert "first-step-run" in sources and "first-step-run" not in [t["source"] for t in run["trials"]], sources
    assert [(t["rung"], t["micro_batch_size"], t["peak_bytes"]) for t in made["trials"]] == \
        [(t["rung"], t["micro_batch_size"], t["peak_bytes"]) for t in run["trials"]]


def test_the_made_peak_is_sorted_by_the_lives_the_made_step_repeats():
    """No torch: a first step that makes an activation (a) and a gradient (g) and frees both; made again, the peak
    of the two steps is in the second (where the kept state S adds to it), its parts those of the first's records.
    A storage the step makes and then resizes (a new life in the first's records, which the made step's cannot be
    told from): None."""
    from types import SimpleNamespace as R

    def made_peak(records, initial, made, events, points, kind_of):  # (as SecondSteps.finish reads a made peak)
        kinds = made_kinds(records, initial, made, events, points, kind_of)
        return peak_parts(Trace.of(initial, made), kinds) if kinds is not None else None

    records = [R(key="S0", at=None, nbytes=512, kind="optimizer_state"),
               R(key="a", at=1, nbytes=1024, kind="activations"), R(key="g", at=2, nbytes=512, kind="gradients"),
               R(key="S", at=5, nbytes=512, kind="optimizer_state")]
    events = [("mark", "forward"), ("set", "a", 1000), ("set", "g", 500), ("free", "a"), ("mark", "optimizer"),
              ("set", "S", 500), ("free", "g"), ("mark", None)]
    points = (0, 7, 7)
    made = with_second_step(events, {"S0"}, points, None)
    assert made_peak(records, [("S0", 512)], made, len(events), points, lambda r: r.kind) == (
        {"optimizer_state": 1024, "activations": 1024, "gradients": 512}, "forward", 2560)
    resized = [*events[:2], ("set", "a", 3000), *events[2:]]
    records = [*records[:2], R(key="a", at=2, nbytes=3072, kind="activations"),
               *[R(key=r.key, at=r.at + 1, nbytes=r.nbytes, kind=r.kind) for r in records[2:]]]
    made = with_second_step(resized, {"S0"}, (0, 8, 8), None)
    assert made_peak(records, [("S0", 512)], made, len(resized), (0, 8, 8), lambda r: r.kind) is None


def test_a_later_block_that_keeps_something_is_checked_with_the_whole_model(monkeypatch):
    """device: fake, a card's rules (T4). A model of 6 blocks of the same classes and shapes whose later ones build a
    mask on their first forward and keep it (tests/search/models/local_layers.py): the whole model's first trial of
    each plan's levers runs both steps and checks; the estimate's plan, breakdown and every trial's figures are
    those of every trial's two steps run (a check made on its first 2 blocks agreed, and the made steps were off by
    3 MiB, one of them under: a review's find). Only trials of a plan that can be the answer (the global batch,
    alone or accumulated) are recorded for a breakdown."""
    import oomtune.search.replayed_trials as replayed
    from oomtune.search.estimate import estimate, make_fake_device
    from oomtune.search.options import resolve_targets

    mf = load_model_file(Path(__file__).parent / "models" / "local_layers.py")
    targets = resolve_targets(mf, 64, 256, None)
    recorded: list[Plan] = []
    real = replayed.recorded_trial
    monkeypatch.setattr(replayed, "recorded_trial", lambda m, p, *a: recorded.append(p) or real(m, p, *a))
    made = estimate(mf, make_fake_device("700MiB", "t4", None), targets)
    assert recorded and {p.micro_batch_size * p.grad_accum_steps for p in recorded} == {64}, recorded
    monkeypatch.setattr(SecondSteps, "mode", lambda *a: None)
    run = estimate(mf, make_fake_device("700MiB", "t4", None), targets)
    assert made.plan == run.plan and made.breakdown == run.breakdown
    assert [(r.rung, r.micro_batch_size, r.grad_accum_steps, r.peak_bytes) for r in made.search.records] == \
        [(r.rung, r.micro_batch_size, r.grad_accum_steps, r.peak_bytes) for r in run.search.records]


def test_a_check_on_fewer_blocks_does_not_hold_for_the_whole_model(tmp_path):
    """device: fake (the estimate's twin, a T4's rules). The model of local_layers.py at 18 blocks, each told from the
    others by its index only (layers from the third on attend locally by their code, as `if self.index >= 2`: the
    blocks are alike, checkpointing._counters), so a check made on its first 2 blocks agrees (neither keeps a mask);
    the whole model's trial of the same levers checks again (its later blocks keep theirs after the first step) and
    runs both steps, its figures those of both steps run. Before, the whole model's second step was made from the
    2-block check: its tensor peak 121,270,272 B against 113,368,576 B run (an estimate falls back to whole trials
    where the extrapolation from 2, 3 and 4 blocks does not line up, as here)."""
    from oomtune.memory.breakdown import static_memory
    from oomtune.search.fewer_blocks import FewerBlocks, Stacks

    path = tmp_path / "local18.py"
    text = ((Path(__file__).parent / "models" / "local_layers.py").read_text()
            .replace("LAYERS = 256, 64, 4, 6", "LAYERS = 256, 64, 4, 18")
            .replace("self.window = window", "self.index = window")
            .replace("if self.window is not None:", "if self.index >= 2:").replace("triu(-self.window)", "triu(-64)")
            .replace("Block(None if i < 2 else 64)", "Block(i)"))
    assert "Block(i)" in text and "self.index >= 2" in text and "self.window" not in text
    path.write_text(text)
    mf = load_model_file(path)
    blocks = Stacks(*static_memory(mf).repeated_blocks)
    plan, device = Plan(2, 256, "fp32"), FakeDevice("80GiB", gpu=find_gpu("t4"), never_runs_out=True, traces=True)
    second = SecondSteps()
    run_trial(FewerBlocks(mf, 2, blocks), plan, device, second=second)
    assert list(second.agreed.values()) == [True]
    whole = run_trial(mf, plan, device, second=second)
    run = run_trial(mf, plan, FakeDevice("80GiB", gpu=find_gpu("t4"), never_runs_out=True, traces=True))
    assert not whole.second_step_made and list(second.agreed.values()) == [True, False]
    for figure in FIGURES:
        assert getattr(whole, figure) == getattr(run, figure), figure
