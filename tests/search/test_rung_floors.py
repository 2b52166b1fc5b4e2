"""Rungs past accumulation whose floor (weights, gradients, optimizer state and step with the rung's levers) is past
the tensor budget are passed without trials (search/rung_floors.py): torch-free on the ladder, then the probe on the
cpu device, where the plan is the one found with those rungs tried, and each floor is measured once."""

from __future__ import annotations

import json

from oomtune.search.ladder import LadderSearch, Measurement, Point, Rung

from ..conftest import EXAMPLES, run_cli

FP32 = Rung("fp32", "fp32", False)
IN_BWD = Rung("step-in-backward", "fp32", False, optimizer_in_backward=True)
TRUE = Rung("bf16-true", "bf16-true", False)
FLOOR = {FP32: 1700, IN_BWD: 1300, TRUE: 800}


def measure(p: Point) -> Measurement:
    peak = FLOOR[p.rung] + p.micro_batch_size * p.context_length // 8 + 10 * p.grad_accum_steps
    return Measurement(oom=True) if peak > 2000 else Measurement(oom=False, peak_bytes=peak)


def test_a_past_rung_that_cannot_reach_is_passed_without_trials_and_only_past_rungs_are_asked():
    asked: list[str] = []

    def reaches(rung: Rung) -> bool:
        asked.append(rung.name)
        return FLOOR[rung] <= 1200

    passed = LadderSearch(measure, 1200)
    passed.reaches = reaches
    r = passed.run([FP32], batch=8, context=64, min_context=64, past=[IN_BWD, TRUE])
    assert asked == ["step-in-backward", "bf16-true"]  # (fp32 is a usual rung: out_of_reach's, not this)
    assert {t.point.rung for t in passed.trials} == {FP32, TRUE}
    assert r.rungs[1].rung == IN_BWD and r.rungs[1].trials == 0 and r.rungs[1].micro_batch_size is None
    tried = LadderSearch(measure, 1200).run([FP32], batch=8, context=64, min_context=64, past=[IN_BWD, TRUE])
    assert tried.choice == r.choice and tried.rungs[1].micro_batch_size is None  # it found nothing there either


def _probe(tmp_path, name: str) -> dict:
    r = run_cli("probe", EXAMPLES / "tiny_gpt.py", "--device", "cpu", "--budget", "3.3MiB", "--batch", "8",
                "--context", "64", "--out", tmp_path / f"{name}.yaml", "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_probe_passes_the_step_in_backward_rung_whose_floor_does_not_fit(tmp_path, monkeypatch):
    """device: cpu. The tiny GPT at 3.3 MiB (2.97 MiB for tensors after the headroom): stepped in backward it still
    holds its fp32 weights and AdamW state, 3.09 MiB, so that rung is passed with a note naming its floor; bf16-true
    (2.06 MiB) is searched. With every past rung tried, the step-in-backward trial runs out of memory and the plan
    is the same."""
    from oomtune.memory import breakdown
    from oomtune.search.rung_floors import RungFloors

    measured: list[str] = []
    real = breakdown.static_memory
    monkeypatch.setattr("oomtune.search.rung_floors.static_memory",
                        lambda mf, plan=None, levers="", **kw: measured.append(levers) or real(mf, plan, levers, **kw))
    report = _probe(tmp_path, "passed")
    assert {t["rung"] for t in report["trials"]} == {"bf16-true"}
    note = next(n for n in report["notes"] if "not tried on the step-in-backward rung past accumulation" in n)
    assert "gradients 0 B" in note and "= 3.09 MiB (with step-in-backward)" in note and "2.97 MiB" in note, note
    assert len(measured) == len(set(measured)) and {"bf16-true", "step-in-backward"} <= set(measured), measured
    # (each once: the floor check measured the chain's last rung and step-in-backward, the climb reused the latter)

    monkeypatch.setattr(RungFloors, "reaches", lambda self, rung, budget: True)
    tried = _probe(tmp_path, "tried")
    assert [(t["rung"], t["result"]) for t in tried["trials"]][:1] == [("step-in-backward", "oom")]
    assert not any("past accumulation:" in n for n in tried["notes"])
    assert tried["plan"] == report["plan"] and report["plan"]["precision"] == "bf16-true"


def test_a_rung_that_keeps_the_weights_as_built_is_passed_on_their_bytes_alone(monkeypatch):
    """No floor is measured for a rung that leaves the weights as built (not bf16-true, not NF4) where the model's
    weights alone are past the budget (a 7B's fp32 weights on a 12 GB card: chunked-loss, step-in-backward); a
    bf16-true rung is measured."""
    from types import SimpleNamespace

    from oomtune.memory.breakdown import StaticMemory
    from oomtune.search import rung_floors

    static = StaticMemory(weights_bytes=1000, gradients_bytes=1000, optimizer_bytes=2000, optimizer_name="AdamW",
                          checkpointing_supported=True)
    measured: list[str] = []
    monkeypatch.setattr(rung_floors, "static_memory", lambda mf, plan, name, **kw: measured.append(name) or
                        StaticMemory(500, 500, 1000, "AdamW", True))
    floors = rung_floors.RungFloors(SimpleNamespace(label="m.py"), static)
    assert not floors.reaches(IN_BWD, 900) and measured == []
    assert floors.reaches(TRUE, 2500) and measured == ["bf16-true"]
    assert not floors.reaches(TRUE, 1500)  # 500 + 500 + 1000 = 2000 (measured once)
    assert measured == ["bf16-true"]
    note = floors.note()[0]
    assert "step-in-backward, bf16-true rungs past accumulation: step-in-backward: weights 1000 B alone; " \
        "bf16-true: weights 500 B + " in note, note


def test_the_step_in_backward_floor_leaves_out_a_whole_steps_scratch(write_model):
    """device: fake. A model file's own AdamW runs foreach on a GPU: one step over every gradient holds a
    parameter-sized scratch, but stepped in backward each hook steps one parameter, so the rung's floor (a bound
    under every plan of it, which passes the rung where it does not fit) counts no step scratch (nor gradients)."""
    from oomtune.config.schema import Plan
    from oomtune.memory.breakdown import static_memory
    from oomtune.model_file import load_model_file

    from ..conftest import TINY_MODEL

    mf = load_model_file(write_model(TINY_MODEL + "\ndef optimizer(params, lr, model):\n"
                                     "    return torch.optim.AdamW(params, lr=lr)\n"))
    plain = static_memory(mf, Plan(1, 1, "fp32"), "fp32")
    stepped = static_memory(mf, Plan(1, 1, "fp32", optimizer_in_backward=True), "step-in-backward")
    assert plain.step_temporaries_bytes > 0  # (foreach: the test would prove nothing without it)
    assert stepped.step_temporaries_bytes == 0 and stepped.gradients_bytes == 0
    assert stepped.floor_bytes == plain.floor_bytes - plain.gradients_bytes - plain.step_temporaries_bytes


def test_each_ladder_notes_the_rungs_it_passed_itself(monkeypatch):
    """One RungFloors serves the prior's fake ladder and the device's, whose budgets differ (the twin's leaves out
    the workspaces): the note after the device's climb names the rungs that climb passed, not the prior's."""
    from types import SimpleNamespace

    from oomtune.memory.breakdown import StaticMemory
    from oomtune.search import rung_floors

    monkeypatch.setattr(rung_floors, "static_memory", lambda mf, plan, name, **kw: StaticMemory(1000, 0, 500,
                                                                                           "AdamW", True))
    floors = rung_floors.RungFloors(SimpleNamespace(label="m.py"), StaticMemory(1000, 1000, 2000, "AdamW", True))
    prior = floors.for_ladder(900)
    assert not prior(IN_BWD) and "step-in-backward" in floors.note()[0]  # the weights alone, past the twin's 900
    device = floors.for_ladder(2000)
    assert device(IN_BWD) and floors.note() == ()  # 1500 fits the device's 2000: its climb passed nothing


def test_a_bf16_true_rung_is_passed_on_its_weights_cast_to_bf16_alone(monkeypatch):
    """A 7B's weights cast to bf16 (13.5 GB) on a 12 GB card: the bf16-true rungs are passed with no floor measured
    (it took three builds of 2, 3 and 4 layers each); an NF4 rung is measured."""
    from types import SimpleNamespace

    from oomtune.memory.breakdown import StaticMemory
    from oomtune.search import rung_floors

    static = StaticMemory(weights_bytes=1000, gradients_bytes=1000, optimizer_bytes=2000, optimizer_name="AdamW",
                          checkpointing_supported=True, bf16_weights_bytes=600)
    measured: list[str] = []
    monkeypatch.setattr(rung_floors, "static_memory", lambda mf, plan, name, **kw: measured.append(name) or
                        StaticMemory(300, 100, 200, "AdamW", True))
    floors = rung_floors.RungFloors(SimpleNamespace(label="m.py"), static)
    nf4 = Rung("bf16-true+nf4", "bf16-true", False, nf4_frozen_weights=True)
    assert not floors.reaches(TRUE, 550) and measured == []
    assert floors.reaches(nf4, 650) and measured == ["bf16-true+nf4"]  # (300 + 100 + 200)
    assert "bf16-true rung past accumulation: weights in bf16 600 B alone" in floors.note()[0]



def test_a_model_that_declares_4_bit_weights_has_its_bf16_true_floor_measured(monkeypatch):
    """A model file whose BitsAndBytesConfig stores its frozen weights in 4 bits (a 7B QLoRA: 4.55 GB built, 12.6 GiB
    if every weight were cast to bf16): the weights cast to bf16 do not bound its bf16-true floor, which keeps those
    weights in 4 bits, so the floor is measured. The bound passed the 7B's bf16-true rungs on a 6.5 GiB RTX 3060
    and the estimate said nothing fits, where bf16-true, 8-bit AdamW and the optimizer offloaded fit at 5.8 GiB."""
    from types import SimpleNamespace

    from oomtune.memory.breakdown import StaticMemory
    from oomtune.search import rung_floors

    static = StaticMemory(weights_bytes=1000, gradients_bytes=10, optimizer_bytes=20, optimizer_name="AdamW",
                          checkpointing_supported=True, bf16_weights_bytes=2600, declared_4bit="bitsandbytes nf4")
    measured: list[str] = []
    monkeypatch.setattr(rung_floors, "static_memory", lambda mf, plan, name, **kw: measured.append(name) or
                        StaticMemory(900, 10, 20, "AdamW", True, declared_4bit="bitsandbytes nf4"))
    floors = rung_floors.RungFloors(SimpleNamespace(label="m.py"), static)
    assert floors.at_least(TRUE) == 0
    assert floors.reaches(TRUE, 1000) and measured == ["bf16-true"]

COMPLEX_AND_VIEWS = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("freqs_cis", torch.polar(torch.ones(512, 64), torch.zeros(512, 64)))  # complex64
        whole = torch.zeros(4096, 64)
        self.part = nn.Parameter(whole[:64])  # a view of a storage 64 times its size
        self.out = nn.Linear(64, 10)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.out(x.float() @ self.part), y)


def build_model():
    return Net()


def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, 64, device=device), torch.randint(0, 10, (batch_size,), device=device)
"""


def test_the_weights_cast_to_bf16_bound_what_a_bf16_true_build_holds(write_model):
    """device: fake. For model files of each kind (GPT, PEFT LoRA Llama, T5 with its fp32 buffers, one that moves
    itself with .to(), Mixtral; a complex buffer, which `.to(bf16)` casts, and a parameter that is a view of a larger
    storage, which it copies alone): the bound is under the bf16-true build's weights, and close."""
    from oomtune.config.schema import Plan
    from oomtune.memory.breakdown import static_memory
    from oomtune.model_file import load_model_file

    from .test_block_extrapolation import MODELS

    for path in (EXAMPLES / "tiny_gpt.py", MODELS / "hf_llama_lora.py", MODELS / "hf_t5.py", MODELS / "moved.py",
                 MODELS / "hf_mixtral_lora.py", write_model(COMPLEX_AND_VIEWS)):
        mf = load_model_file(path)
        bound = static_memory(mf).bf16_weights_bytes
        true = static_memory(mf, Plan(1, 1, "bf16-true"), "bf16-true", checks=False).weights_bytes
        assert 0.9 * true <= bound <= true, (path.name, bound, true)
