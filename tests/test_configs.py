"""Every example config in configs/ loads, trains a few steps and passes `oomtune check` (devices: cpu, fake)."""

import pytest
import yaml

from oomtune.model_file import load_model_file
from oomtune.plan import load_config

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
