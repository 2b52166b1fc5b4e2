"""estimate --breakdown: what each lever of a plan takes off its peak, the plan estimated again with that lever off.
device: fake (estimate). Each saving is checked against the what-if of that other plan run on its own, to the byte."""

from __future__ import annotations

import json
from importlib.util import find_spec

import pytest

from oomtune.config.schema import Plan
from oomtune.search.savings import without_each

from ..conftest import run_cli

V = 4096


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """A one-layer Llama whose logits dominate its memory (a Hugging Face folder: config.json, no weights)."""
    if find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("wide-llama")
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, vocab_size=V, max_position_embeddings=256,
                architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    return folder


def _what_if(folder, *args: str) -> dict:
    r = run_cli("estimate", folder, "--budget", "1GiB", "--micro-batch", "4", "--context", "128", *args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_each_saving_is_the_plan_without_that_lever_estimated_alone(wide_llama):
    full = ("--precision", "bf16-true", "--checkpointing", "--levers", "chunked-loss")
    report = _what_if(wide_llama, *full, "--breakdown")
    peak = report["breakdown"]["peak_bytes"]
    savings = {s["lever"]: s for s in report["savings"]}
    assert set(savings) == {"chunked_loss", "activation_checkpointing", "precision"}, savings
    alone = {"chunked_loss": ("--precision", "bf16-true", "--checkpointing"),
             "activation_checkpointing": ("--precision", "bf16-true", "--levers", "chunked-loss"),
             "precision": ("--precision", "bf16", "--checkpointing", "--levers", "chunked-loss")}
    for lever, args in alone.items():
        without = _what_if(wide_llama, *args)["breakdown"]["peak_bytes"]
        assert savings[lever]["peak_bytes"] == without, lever
        assert savings[lever]["saved_bytes"] == without - peak, lever
        print(f"{lever}: {without:,} B without it, saves {without - peak:,} B")
    assert savings["chunked_loss"]["saved_bytes"] > 0 and savings["precision"]["saved_bytes"] > 0
    assert "savings" not in _what_if(wide_llama, *full)  # (asked for only)


def test_the_ladder_names_the_savings_of_the_plan_it_chose(wide_llama, write_model, tmp_path):
    """Nothing fits before the chunked-loss rung: the chosen plan's levers, each with its saving; a plan with no
    lever says so."""
    r = run_cli("estimate", wide_llama, "--budget", "14MiB", "--margin", "0", "--batch", "8", "--context", "256",
                "--min-context", "256", "--breakdown", "--out", tmp_path / "best.yaml", "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    plan = Plan(**report["breakdown_plan"])
    assert plan.chunked_loss, plan  # (the rung it needed)
    assert [s["lever"] for s in report["savings"]] == [key for key, _, _ in without_each(plan)] != []
    assert all(s["saved_bytes"] == s["peak_bytes"] - report["breakdown"]["peak_bytes"] for s in report["savings"])
    chunked = next(s for s in report["savings"] if s["lever"] == "chunked_loss")
    assert chunked["peak_bytes"] > 14 << 20  # (without it, the plan does not fit: why the ladder climbed to it)
    others = [key for key, _, _ in without_each(plan) if key not in ("chunked_loss", "precision",
                                                                   "activation_checkpointing")]
    assert others == [], others  # (so the plan without it is this what-if:)
    alone = run_cli("estimate", wide_llama, "--budget", "14MiB", "--margin", "0", "--micro-batch",
                    str(plan.micro_batch_size), "--context", str(plan.context_length), "--precision", plan.precision,
                    "--grad-accum", str(plan.grad_accum_steps),
                    *(["--checkpointing"] if plan.activation_checkpointing else []), "--json")
    assert json.loads(alone.stdout)["breakdown"]["peak_bytes"] == chunked["peak_bytes"], alone.output
    plain = run_cli("estimate", write_model(), "--budget", "1GiB", "--micro-batch", "2", "--context", "4",
                    "--breakdown")
    assert plain.exit_code == 0, plain.output
    assert "none: the plan uses no lever" in plain.stdout


def test_without_each_turns_one_lever_off_at_a_time():
    plan = Plan(2, 8, "bf16-true", activation_checkpointing=True, chunked_loss=True, compile=True,
                optimizer_8bit=True)
    offs = {key: other for key, _, other in without_each(plan)}
    assert set(offs) == {"compile", "chunked_loss", "optimizer_8bit", "activation_checkpointing", "precision"}
    assert offs["precision"].precision == "bf16" and offs["compile"].compile is False
    for key, other in offs.items():
        changed = {f for f in ("compile", "chunked_loss", "optimizer_8bit", "activation_checkpointing", "precision")
                   if getattr(other, f) != getattr(plan, f)}
        assert changed == {key}, key
    assert without_each(Plan(2, 8, "bf16"))[0][2].precision == "fp32"
    built_in_bf16 = dict((key, other) for key, _, other in without_each(plan, "bfloat16"))
    assert built_in_bf16["precision"] == ("build_model() returns its trained weights in bfloat16: without bf16-true "
                                          "they stay so")  # (nothing to compare: not a 0 B saving)
    assert without_each(Plan(2, 8)) == []
