"""The torchtune export against torchtune's own recipe configs (device: none). torchtune is not in the test extra:
its dependencies are heavy, and its 0.6 release does not import beside torchao 0.18, so this reads the recipes as
files. Where it is missing the test is skipped; to run it: pip install --no-deps torchtune omegaconf."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest

from oomtune.config.export import export

from .test_export import PLANS


def recipes_folder() -> Path:
    try:
        folder = Path(metadata.distribution("torchtune").locate_file("recipes"))
    except metadata.PackageNotFoundError:
        pytest.skip("torchtune is not installed (pip install --no-deps torchtune omegaconf)")
    if not (folder / "configs").is_dir():
        pytest.skip(f"torchtune's recipe configs are not at {folder / 'configs'}")
    return folder


def keys_of(node, prefix: str = "") -> set[str]:
    if not isinstance(node, dict):
        return set()
    return {f"{prefix}{k}" for k in node} | {key for k, v in node.items() for key in keys_of(v, f"{prefix}{k}.")}


RECIPES = ["llama3_2/1B_lora_single_device.yaml", "llama3_2/1B_qlora_single_device.yaml", "llama3_2/1B_full.yaml",
           "llama3_2/1B_full_single_device.yaml"]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", sorted(PLANS))
def test_every_override_is_a_key_torchtune_reads_and_merges_to_the_plan(name, recipe):
    folder = recipes_folder()
    omegaconf = pytest.importorskip("omegaconf")
    plan = PLANS[name]
    lines = export(plan, "torchtune").text().splitlines()
    path = folder / "configs" / recipe
    config = omegaconf.OmegaConf.load(path)
    known = keys_of(omegaconf.OmegaConf.to_container(config))
    runner = re.search(r"tune run (?:--nproc_per_node \d+ )?(\w+)", path.read_text()).group(1)  # its recipe
    read = set(re.findall(r'cfg\.get\(\s*"([a-z_]+)"', (folder / f"{runner}.py").read_text()))
    unknown = [line.split("=")[0] for line in lines if line.split("=")[0] not in known | read]
    assert unknown == []  # no key the recipe would not read (each is in its config, or the recipe reads it)
    merged = omegaconf.OmegaConf.merge(config, omegaconf.OmegaConf.from_dotlist(lines))  # as `tune run ... k=v`
    assert merged.batch_size == plan.micro_batch_size
    assert merged.gradient_accumulation_steps == plan.grad_accum_steps
    assert merged.enable_activation_checkpointing is plan.activation_checkpointing
    assert merged.tokenizer.max_seq_len == plan.context_length
    assert merged.optimizer._component_ == ("torchao.optim.AdamW8bit" if plan.optimizer_8bit else "torch.optim.AdamW")
    expressed = {"fp32": "fp32", "bf16-true": "bf16"}.get(plan.precision)
    assert merged.dtype == (expressed or config.dtype)  # autocast: the recipe's dtype kept, and said
    assert expressed or any(u.startswith(f"precision: {plan.precision} is autocast") for u in
                            export(plan, "torchtune").unexpressed)
    if merged.enable_activation_offloading and not merged.enable_activation_checkpointing:  # the recipes refuse it
        assert any(u.startswith("offload_activations: torchtune") for u in export(plan, "torchtune").unexpressed)



def test_optimizer_offload_is_a_note_single_device_recipes_have_no_key_for():
    recipes_folder()
    single = export(PLANS["fp32+offload"], "torchtune")
    assert "offload" not in single.text().replace("enable_activation_offloading", "")
    assert any(u.startswith("offload_optimizer: torchtune offloads with fsdp_cpu_offload") for u in single.unexpressed)
