"""A model whose build_model() returns its weights in bf16 (a Hugging Face config.json saying torch_dtype bfloat16:
tests/search/models/bf16_config.py): its plans say what they train, bf16-true, and train so. Devices: fake (estimate)
and cpu (train)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from oomtune.train.checkpoint import load_checkpoint
from tests.conftest import run_cli

BF16_CONFIG = Path(__file__).parent / "models" / "bf16_config.py"
NOTE = ("bf16_config.py's trained weights are bfloat16, as build_model() returns them: every plan trains them "
        "bf16-true (weights, gradients and AdamW state in bf16, no fp32 copy; its precision says so), and the ladder "
        "has no amp rung (autocast would only add copies of them) and no bf16-true rung past accumulation (it is the "
        "case already); for fp32 master weights with mixed precision, build the model in fp32 (from_config / "
        "from_pretrained with dtype=torch.float32")


def _estimate(out: Path, *args: str) -> dict:
    r = run_cli("estimate", BF16_CONFIG, "--margin", "0", "--out", out, "--json", *args)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_a_model_built_in_bf16_from_its_config_is_planned_bf16_true(tmp_path):
    """device: fake. from_config on a config saying torch_dtype bfloat16 builds bf16 weights; the plan said
    precision: fp32 (its rung named fp32) while weights, gradients and AdamW state were bf16. Now the rung and the
    plan say bf16-true, and the output and the config's found_by.notes say why and how to get fp32 master weights."""
    report = _estimate(tmp_path / "e.yaml", "--budget", "64MiB")
    assert [(r["rung"], r["precision"]) for r in report["rungs"]] == [("bf16-true", "bf16-true")]
    written = yaml.safe_load((tmp_path / "e.yaml").read_text())
    assert report["plan"]["precision"] == written["plan"]["precision"] == "bf16-true"
    assert [n for n in report["notes"] if n.startswith(NOTE)] and written["found_by"]["notes"] == report["notes"]


def test_the_ladder_climbs_no_bf16_true_rung_that_is_the_case_already(tmp_path):
    """device: fake. Where no usual rung fits micro-batch 1, the ladder climbed a bf16-true rung past accumulation
    that measured the first rung's peak to the byte (the weights were bf16 already), and said nothing. Now there is
    none, a note says why, and the rungs past accumulation (8-bit, offload) are over those bf16 weights. (Micro-batch
    1 peaks at 1,101,312 B on the first rung: 1100 KiB leaves 990 KiB.)"""
    report = _estimate(tmp_path / "e.yaml", "--budget", "1100KiB")
    assert [(r["rung"], r["precision"]) for r in report["rungs"]] == [
        ("bf16-true", "bf16-true"), ("checkpointing", "bf16-true"), ("bf16-true+chunked-loss", "bf16-true"),
        ("bf16-true+chunked-loss+step-in-backward", "bf16-true"), ("bf16-true+chunked-loss+8bit", "bf16-true"),
        ("bf16-true+chunked-loss+8bit+offload", "bf16-true")]
    assert ("no bf16-true rung: bf16_config.py's trained weights are bfloat16, as build_model() returns them: every "
            "rung trains bf16-true already") in report["notes"]
    plan = report["plan"]
    assert (plan["precision"], plan["optimizer_8bit"], plan["offload_optimizer"]) == ("bf16-true", True, True)


def test_training_the_plan_trains_what_its_precision_says(tmp_path, monkeypatch):
    """device: cpu. The plan says bf16-true and training keeps the weights and AdamW's moments in bf16, as the label
    says (it said fp32 of the same bf16 training). A config saying fp32 for this model (written before, or by hand)
    trains it so too, and train says so before the first step."""
    monkeypatch.chdir(tmp_path)
    _estimate(tmp_path / "e.yaml", "--budget", "64MiB")
    r = run_cli("train", "--config", "e.yaml", "--device", "cpu", "--budget", "1GiB", "--steps", "2",
                "--eval-steps", "1", "--run-dir", "run")
    assert r.exit_code == 0, r.output
    assert "plan.precision is" not in r.stderr
    state = load_checkpoint(tmp_path / "run" / "ckpt-00000002.pt")
    assert {str(t.dtype) for t in state["model"].values() if t.is_floating_point()} == {"torch.bfloat16"}
    moments = [s[k] for s in state["optimizer"]["state"].values() for k in ("exp_avg", "exp_avg_sq")]
    assert moments and {str(m.dtype) for m in moments} == {"torch.bfloat16"}
    config = yaml.safe_load((tmp_path / "e.yaml").read_text())
    config["plan"]["precision"] = "fp32"
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(config))
    r = run_cli("train", "--config", "old.yaml", "--device", "cpu", "--budget", "1GiB", "--steps", "1",
                "--eval-steps", "1", "--run-dir", "old")
    assert r.exit_code == 0, r.output
    assert ("plan.precision is fp32, but bf16_config.py's build_model() returns its trained weights in bfloat16: it "
            "trains them, their gradients and AdamW state in bfloat16, with no fp32 copy (set plan.precision: "
            "bf16-true to say so") in " ".join(r.stderr.split())


def test_a_what_if_plan_that_says_fp32_of_bf16_weights_says_what_it_trains():
    """device: fake. estimate --micro-batch's plan is fp32 unless --precision says otherwise: of this model it measures
    bf16 weights, gradients and AdamW state under that label, and now says so; --precision bf16-true says nothing."""
    def notes(*args: str) -> list[str]:
        r = run_cli("estimate", BF16_CONFIG, "--budget", "64MiB", "--margin", "0", "--micro-batch", "2", "--json",
                    *args)
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)["notes"]

    assert ("plan.precision is fp32, but bf16_config.py's build_model() returns its trained weights in bfloat16: it "
            "trains them, their gradients and AdamW state in bfloat16, with no fp32 copy (--precision bf16-true to "
            "say so, or build the model in fp32 for fp32 master weights under autocast)") in notes()
    assert not [n for n in notes("--precision", "bf16-true") if "plan.precision is" in n]


def test_bf16_true_keeps_what_a_model_built_in_bf16_keeps_in_fp32():
    """device: cpu. The plan of a model built in bf16 is bf16-true, whose lever cast the whole model to bf16: the
    rotary frequencies the model keeps in fp32 (a buffer) became bf16, and every position's angle drifted from the
    model as built (it trained in fp32 frequencies under the 'fp32' label). Its trained weights are bf16 as built, so
    it is kept as built; an fp32 model's bf16-true still casts every weight and buffer (tests/levers)."""
    from oomtune.config.schema import Plan
    from oomtune.memory.devices import make_device
    from oomtune.model_file import load_model_file
    from oomtune.step import build_training

    mf = load_model_file(BF16_CONFIG)
    built = mf.build().model.rotary_emb.inv_freq
    t = build_training(mf, Plan(1, 8, "bf16-true"), make_device("cpu", "1GiB"), lr=1e-3)
    kept = t.module.model.rotary_emb.inv_freq
    assert built.dtype == kept.dtype == torch.float32 and torch.equal(built, kept)
    assert {p.dtype for p in t.module.parameters()} == {torch.bfloat16}
