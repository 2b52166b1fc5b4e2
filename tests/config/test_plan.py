"""Config files: strict round-trip through frozen dataclasses, atomic writes, clear errors naming the key."""

import dataclasses
import os
from pathlib import Path

import pytest

from oomtune.config.loading import load_config
from oomtune.config.schema import Config, FoundBy, Plan, TrainConfig, TrialRecord
from oomtune.config.writing import dump_config, save_config
from oomtune.errors import ConfigError

PLAN = Plan(micro_batch_size=4, context_length=128, precision="bf16", activation_checkpointing=True,
            grad_accum_steps=8)


def make_config(model="model.py"):
    trial = TrialRecord(rung="amp", stage="batch", micro_batch_size=4, context_length=128, grad_accum_steps=1,
                        precision="bf16", activation_checkpointing=False, result="fits", peak_bytes=123456,
                        tokens_per_s=1000.5, seconds=0.25)
    found = FoundBy(command="probe", estimated=False, device="cpu", gpu_name="cpu", budget_bytes=1 << 20,
                    headroom=0.1, objective="fit", target_batch=32, target_context=128, min_context=128,
                    peak_bytes=123456, tokens_per_s=1000.5, torch_version="2.13.0", cuda_version=None,
                    oomtune_version="0.1.0", date="2026-11-30T00:00:00+00:00", trials=(trial, trial))
    return Config(model=model, plan=PLAN, train=TrainConfig(steps=50, lr=1e-3), found_by=found)


def test_round_trip(tmp_path):
    cfg = make_config()
    save_config(cfg, tmp_path / "best.yaml", header="hello")
    text = (tmp_path / "best.yaml").read_text()
    assert text.startswith("# hello\n")
    assert "activation_checkpointing: true  # less memory, ~30% more compute" in text
    assert load_config(tmp_path / "best.yaml") == cfg
    assert PLAN.global_batch_size == 32


def test_model_path_is_stored_relative_to_the_config_wherever_they_share_a_folder(tmp_path):
    (tmp_path / "m.py").write_text("")
    save_config(make_config(model=str(tmp_path / "m.py")), tmp_path / "sub" / ".." / "best.yaml")
    cfg = load_config(tmp_path / "best.yaml")
    assert cfg.model.source == "m.py" and cfg.model_path(tmp_path / "best.yaml") == tmp_path / "m.py"
    beside = tmp_path / "cfgs" / "ci" / "best.yaml"  # a config folder next to the model's: ../ keeps it portable
    beside.parent.mkdir(parents=True)
    save_config(make_config(model=str(tmp_path / "m.py")), beside)
    cfg = load_config(beside)
    assert cfg.model.source == "../../m.py" and cfg.model_path(beside).resolve() == (tmp_path / "m.py").resolve()
    top = Path(tmp_path.resolve().parts[1])  # e.g. /tmp: shared by unrelated projects, so no ../../ through it
    for far in (Path("/") / top / "oomtune-elsewhere" / "m.py", Path("/srv-oomtune-none/m.py")):
        save_config(make_config(model=str(far)), beside)
        assert load_config(beside).model.source == str(far)


@pytest.mark.parametrize("edit, message", [
    (("plan:\n", "plan:\n  micro_batch: 3\n"), r"unknown key plan\.micro_batch \(allowed: activation_checkpointing"),
    (("train:\n", "train:\n  epochs: 3\n"), r"unknown key train\.epochs"),
    (("\nplan:", "\nmodle: x\nplan:"), r"unknown key modle"),
    (("  steps: 50", "  steps: fifty"), r"train\.steps: expected int, got 'fifty'"),
    (("  steps: 50", "  steps: 50.0"), r"train\.steps: expected int, got 50\.0"),
    (("activation_checkpointing: true", "activation_checkpointing: 1"),
     r"plan\.activation_checkpointing: expected bool"),
    (("precision: bf16", "precision: fp8"),
     r"plan\.precision: expected 'fp32' \| 'bf16' \| 'fp16' \| 'bf16-true', got 'fp8'"),
    (("global_batch_size: 32", "global_batch_size: 30"), r"plan\.global_batch_size is 30 but micro_batch_size x"),
    (("  micro_batch_size: 4", "  micro_batch_size: 0"), r"plan\.micro_batch_size must be at least 1"),
    (("result: fits", "result: maybe"), r"found_by\.trials\[0\]\.result: expected"),
    (("\nplan:", "\nmodel: other.py\nplan:"),  # PyYAML alone would keep the last one
     r"not valid YAML at line 3: key 'model' appears twice \(lines 1 and 3\)"),
    (("  lr: 0.001", "  lr: 0.001\n  lr: 0.1"), r"key 'lr' appears twice"),
    (("budget_bytes: 1048576", "budget_bytes: -1"), r"found_by\.budget_bytes must be more than 0, got -1"),
    (("  lr: 0.001", "  lr: 3e-4x"), r"train\.lr: expected float, got '3e-4x'"),
    (("  seed: 1337", "  seed: 99999999999999999999999"),  # (torch: "Overflow when unpacking long")
     r"train\.seed must be from 0 to 2\*\*63 - 1, got 99999999999999999999999"),
    (("  seed: 1337", "  seed: -1"), r"train\.seed must be from 0"),
])
def test_bad_keys_and_types_are_named(tmp_path, edit, message):
    path = tmp_path / "best.yaml"
    save_config(make_config(), path)
    text = path.read_text()
    assert edit[0] in text
    path.write_text(text.replace(edit[0], edit[1], 1))
    with pytest.raises(ConfigError, match=message):
        load_config(path)


@pytest.mark.parametrize("written, value", [("3e-4", 3e-4), ("1E-3", 1e-3), ("'2.5e-3'", 2.5e-3), ("0.001", 0.001)])
def test_a_float_in_exponent_form_is_a_float(tmp_path, written, value):
    """YAML 1.1 (PyYAML) reads `lr: 3e-4` as the string '3e-4' (it wants `3.0e-4`): how most people write a
    learning rate, so a float field takes it."""
    path = tmp_path / "best.yaml"
    save_config(make_config(), path)
    path.write_text(path.read_text().replace("  lr: 0.001", f"  lr: {written}", 1))
    assert load_config(path).train.lr == value


def test_missing_keys_and_files_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "none.yaml")
    (tmp_path / "a.yaml").write_text("model: m.py\nplan: {micro_batch_size: 2}\n")
    with pytest.raises(ConfigError, match="missing key plan.context_length"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "b.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_config(tmp_path / "b.yaml")
    (tmp_path / "c.yaml").write_text("- just a list\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(tmp_path / "c.yaml")
    with pytest.raises(ConfigError, match="is a folder, not a config file"):
        load_config(tmp_path)
    for section, text in (("plan", "plan: null\n"), ("train", "plan: {micro_batch_size: 2, context_length: 8}\n"
                                                          "train: null\n")):  # (it said "expected Plan, got None")
        (tmp_path / "e.yaml").write_text("model: m.py\n" + text)
        with pytest.raises(ConfigError, match=f"e.yaml: {section}: expected a mapping of its keys, got None"):
            load_config(tmp_path / "e.yaml")
    (tmp_path / "d.yaml").write_bytes(b"model: m.py\n\xff\xfe\n")
    with pytest.raises(ConfigError, match=r"d\.yaml: not a text file in UTF-8 \(byte 12 is 0xff\)"):
        load_config(tmp_path / "d.yaml")


def test_a_yaml_merge_key_is_not_a_key_given_twice(tmp_path):
    (tmp_path / "merge.yaml").write_text("model: m.py\nplan: &p {micro_batch_size: 2, context_length: 16}\n"
                                         "train:\n  <<: {lr: 0.001, steps: 5}\n  <<: {seed: 7}\n  steps: 9\n")
    cfg = load_config(tmp_path / "merge.yaml")
    assert (cfg.train.lr, cfg.train.steps, cfg.train.seed) == (0.001, 9, 7)


def test_a_config_without_found_by_is_a_hand_written_config(tmp_path):
    (tmp_path / "hand.yaml").write_text("model: m.py\nplan:\n  micro_batch_size: 2\n  context_length: 16\n")
    cfg = load_config(tmp_path / "hand.yaml")
    assert cfg.found_by is None and cfg.train == TrainConfig() and cfg.plan.global_batch_size == 2


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "best.yaml"
    save_config(make_config(), path)
    before = path.read_text()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        save_config(dataclasses.replace(make_config(), train=TrainConfig(steps=7)), path)
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.yaml"]


def test_every_example_config_loads(tmp_path):
    from ..conftest import ROOT

    configs = sorted((ROOT / "configs").glob("*.yaml"))
    assert configs, "configs/ has example configs"
    for path in configs:
        cfg = load_config(path)
        assert cfg.model_path(path).is_file(), f"{path.name}: model {cfg.model} exists"
        assert dump_config(cfg)  # and it writes back out


def test_fp16_with_offloaded_optimizer_is_refused_in_one_line(tmp_path):
    """fp16's GradScaler unscales gradients on the device, which offload_optimizer has moved to the host: the
    step fails inside torch ("No inf checks were recorded"). The plan is refused where it is made, as sharding
    with the levers is, so `estimate --micro-batch N --precision fp16 --levers offload` exits 2, not 1."""
    from tests.conftest import TINY_MODEL, run_cli

    with pytest.raises(ConfigError, match=r"plan\.precision is fp16: offload_optimizer"):
        Plan(micro_batch_size=2, context_length=64, precision="fp16", offload_optimizer=True)
    Plan(micro_batch_size=2, context_length=64, precision="fp32", offload_optimizer=True)  # the ladder's own
    Plan(micro_batch_size=2, context_length=64, precision="fp16", optimizer_8bit=True)
    model = tmp_path / "m.py"
    model.write_text(TINY_MODEL)
    result = run_cli("estimate", model, "--gpu", "rtx3060", "--micro-batch", "2", "--context", "4",
                     "--precision", "fp16", "--levers", "offload")
    assert result.exit_code == 2, result.output
    assert "AssertionError" not in result.output and "offload_optimizer" in result.output


def test_an_out_of_memory_rewrite_of_a_config_naming_its_model_by_a_string_edits_the_plan_in_place(tmp_path):
    """A config written as `model: m.py` (before model: was a section): the plan's numbers change in place, the
    person's comments stay."""
    import dataclasses

    from oomtune.config.writing import rewrite_plan

    path = tmp_path / "c.yaml"
    path.write_text("model: m.py  # my model\nplan:\n  micro_batch_size: 4  # mine\n  context_length: 128\n"
                    "  grad_accum_steps: 1\n  global_batch_size: 4\n")
    started = load_config(path).plan
    smaller = dataclasses.replace(started, micro_batch_size=2, grad_accum_steps=2)
    rewrite_plan(path, started, smaller, "halved")
    text = path.read_text()
    assert "model: m.py  # my model" in text and "micro_batch_size: 2  # mine" in text
    assert load_config(path).plan == smaller
