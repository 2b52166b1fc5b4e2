"""Every example config in configs/ loads, trains a few steps and passes `oomtune check` (devices: cpu, fake)."""

import pytest
import yaml

from oomtune.config.loading import load_config
from oomtune.model_file import load_model_file

from .conftest import ROOT, metrics, run_cli

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_example_config_trains_and_checks(tmp_path, path):
    cfg = load_config(path)
    data = yaml.safe_load(path.read_text())
    data["model"] = str(cfg.model_path(path))  # a copy elsewhere: train may rewrite its plan, never the example
    copy = tmp_path / path.name
    copy.write_text(yaml.safe_dump(data, sort_keys=False))

    r = run_cli("train", "--config", copy, "--device", "cpu", "--budget", "1GiB", "--steps", "3",
                "--eval-interval", "3", "--eval-steps", "1", "--log-every-n-steps", "1", "--run-dir", tmp_path / "run")
    assert r.exit_code == 0, r.output
    rows = metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(row["micro_batch_size"] == cfg.plan.micro_batch_size for row in rows)
    has_eval = load_model_file(cfg.model_path(path)).has("eval_batches")
    assert ("eval_loss" in rows[-1]) == has_eval  # no eval set, no eval: synthetic batches would mean nothing

    r = run_cli("check", "--config", copy, "--budget", "1GiB")
    assert r.exit_code == 0, r.output


# -- a rewritten config keeps each section whose values it keeps as its author wrote it -----------

def test_keep_unchanged_text_keeps_comments_and_layout_only_where_the_values_are_the_same():
    from oomtune.config.text import keep_unchanged_text

    old = ("# my notes\nmodel: m.py  # the small one\nplan:\n  micro_batch_size: 4  # was 8\n"
           "train:\n  # tuned by hand\n  lr: 0.001  # from the sweep\n\n  steps: 50\n"
           "# about found_by\nfound_by: {command: probe}\n")
    new = ("# written by oomtune\nmodel: m.py\nplan:\n  micro_batch_size: 2\n"
           "train:\n  steps: 50\n  lr: 0.001\nfound_by: {}\n")
    kept = keep_unchanged_text(old, new)
    # model and train keep their text; plan and found_by changed, so they are new; the header is oomtune's
    assert kept == ("# written by oomtune\nmodel: m.py  # the small one\nplan:\n  micro_batch_size: 2\n"
                    "train:\n  # tuned by hand\n  lr: 0.001  # from the sweep\n\n  steps: 50\nfound_by: {}\n")
    changed = new.replace("steps: 50", "steps: 60")
    assert keep_unchanged_text(old, changed) == changed.replace("model: m.py", "model: m.py  # the small one")
    # a comment above an unchanged block moves with it
    same_found = new.replace("found_by: {}", "found_by: {command: probe}")
    assert "# about found_by\nfound_by: {command: probe}\n" in keep_unchanged_text(old, same_found)
    flow = "model: m.py\ntrain: {lr: 0.001, steps: 50}  # inline\nplan: {micro_batch_size: 4}"
    assert "train: {lr: 0.001, steps: 50}  # inline\n" in keep_unchanged_text(flow, new)
    twice = "model: m.py\ntrain:\n  lr: 0.5\n  lr: 0.001\n  steps: 50\n"  # plain PyYAML would read it as new's
    for broken in ("model: x.py\ntrain:\n  lr: [\n", "other: 1\n", "", "train: 1\ntrain: 2\n", twice):
        assert keep_unchanged_text(broken, new) == new  # nothing to keep, or not YAML oomtune can keep
    for text in (old, flow):  # whatever is kept, the result reads as the new text does
        import yaml
        assert yaml.safe_load(keep_unchanged_text(text, new)) == yaml.safe_load(new)


def test_save_config_over_a_config_keeps_the_comments_of_sections_it_does_not_change(tmp_path):
    import dataclasses

    from oomtune.config.writing import save_config

    p = tmp_path / "best.yaml"
    cfg = load_config(CONFIGS[0])
    save_config(cfg, p)
    p.write_text(p.read_text().replace("train:\n", "train:  # my run\n  # lr from a sweep\n")
                 .replace("plan:", "# the plan below was probed on the 24 GiB card\nplan:"))
    save_config(dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, precision="fp16")), p)
    assert "train:  # my run\n  # lr from a sweep\n" in p.read_text()
    assert "24 GiB card" not in p.read_text()  # the plan changed: its comment went with it
    assert load_config(p).plan.precision == "fp16"
    save_config(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=3)), p)  # new values: fresh
    assert "# my run" not in p.read_text() and load_config(p).train.steps == 3

