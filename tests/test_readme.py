"""Every `oomtune` command in README.md runs as written, in order, from a copy of the repository's examples and
configs (device: cpu and fake; nothing needs a GPU but the lines marked `# needs a GPU`, which are skipped and
listed). A line ending `# exits N` must exit N; every other line must exit 0."""

from __future__ import annotations

import re
import shlex
import shutil

import pytest

from oomtune.config.loading import load_config

from .conftest import ROOT, run_cli

GPU_ONLY = "needs a GPU"


def readme_commands() -> list[tuple[str, str]]:
    """(command, comment) of each line starting with `oomtune ` in README.md's ```bash blocks."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    found = []
    for block in blocks:
        for line in block.splitlines():
            if line.startswith("oomtune "):
                command, _, comment = line.partition("  #")
                found.append((command.strip(), comment.strip()))
    return found


def test_the_readmes_python_snippets_run(tmp_path, monkeypatch):
    """Each ```python block that is a program (it starts with an import), in order, in one namespace, after the
    quickstart's probe wrote best.yaml. The oomtune they run is this checkout's, as `python -m oomtune`."""
    for folder in ("examples", "configs"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    monkeypatch.chdir(tmp_path)
    assert run_cli("probe", "examples/tiny_gpt.py", "--device", "cpu", "--budget", "12MiB", "--out",
                   "best.yaml").exit_code == 0
    blocks = [b for b in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
              if b.startswith(("import ", "from "))]  # (the model-file contract's block lists signatures)
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - the README's own code, as a user runs it
    assert namespace["args"].per_device_train_batch_size == namespace["kwargs"]["per_device_train_batch_size"]
    assert namespace["trainer"].accumulate_grad_batches == load_config("best.yaml").plan.grad_accum_steps
    assert namespace["accelerate_config"].num_processes == 1
    assert namespace["result"].plan is not None and namespace["probed"].plan == load_config("api.yaml").plan


def test_every_oomtune_command_in_the_readme_runs_as_written(tmp_path, monkeypatch):
    commands = readme_commands()
    assert len(commands) >= 8  # probe, estimate, check, train and gpus, each at least once
    assert {c.split()[1] for c, _ in commands} >= {"probe", "estimate", "check", "train", "gpus"}
    for folder in ("examples", "configs"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    monkeypatch.chdir(tmp_path)
    skipped = []
    for command, comment in commands:
        if GPU_ONLY in comment:
            skipped.append(command)
            continue
        expected = int(m[1]) if (m := re.search(r"exits (\d+)", comment)) else 0
        result = run_cli(*shlex.split(command)[1:])
        assert result.exit_code == expected, f"{command}\n{result.output}"
    print("skipped (they need a GPU):", skipped)
    # the quickstart's probe is `make demo`'s: its 12 MiB must push tiny_gpt past fp32, or the demo shows no ladder
    demo = load_config(tmp_path / "best.yaml")
    fp32 = [t for t in demo.found_by.trials if t.rung == "fp32"]
    assert fp32 and not any(t.micro_batch_size >= 16 and t.result == "fits" for t in fp32)  # fp32 does not hold 16
    assert (demo.plan.precision, demo.plan.global_batch_size) == ("bf16", 16)
    assert all("--device cuda" in c or "--nproc-per-node" in c for c in skipped)  # nothing else may skip
    assert len(skipped) <= 2


@pytest.mark.parametrize("path", ["README.md"])
def test_the_readme_is_short_and_links_only_to_files_that_exist(path):
    text = (ROOT / path).read_text()
    assert len(text.splitlines()) <= 300
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links and all((ROOT / link).exists() for link in links if "://" not in link), links
