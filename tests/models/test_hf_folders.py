"""A Hugging Face model needs no model file (issue 41): a folder of tiny configs (Llama, Qwen2, GPT-2, BERT, T5),
written here with transformers' own save_pretrained, estimated, probed, checked and trained with nothing but the
command line; LoRA from flags; the model's arguments recorded in the config and rebuilt from it; the adapter saved
at the end loads with PeftModel.from_pretrained. Devices: fake (estimate, check) and cpu (probe, train)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from oomtune import api
from oomtune.config.loading import load_config
from oomtune.config.schema import LoraSection, ModelSection
from oomtune.models.source import open_model

from ..conftest import one_line_error, run_cli

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

SMALL = {"vocab_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
KINDS = {  # folder name -> (config, the task its architectures say)
    "llama": (lambda: transformers.LlamaConfig(**SMALL, hidden_size=32, intermediate_size=64, num_key_value_heads=2,
                                               max_position_embeddings=128, architectures=["LlamaForCausalLM"]),
              "causal-lm"),
    "qwen2": (lambda: transformers.Qwen2Config(**SMALL, hidden_size=32, intermediate_size=64, num_key_value_heads=2,
                                               max_position_embeddings=128, architectures=["Qwen2ForCausalLM"]),
              "causal-lm"),
    "gpt2": (lambda: transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                             bos_token_id=0, eos_token_id=0, architectures=["GPT2LMHeadModel"]),
             "causal-lm"),
    "bert": (lambda: transformers.BertConfig(**SMALL, hidden_size=32, intermediate_size=64,
                                             max_position_embeddings=128, architectures=["BertForMaskedLM"]),
             "sequence-classification"),
    "t5": (lambda: transformers.T5Config(vocab_size=128, d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4,
                                         architectures=["T5ForConditionalGeneration"]), "seq2seq"),
}

LLAMA_FILE = '''
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

def build_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, num_hidden_layers=2, num_attention_heads=4, hidden_size=32,
                         intermediate_size=64, num_key_value_heads=2, max_position_embeddings=128)
    return get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))

def make_batch(batch_size, context_length, device):
    ids = torch.randint(0, 128, (batch_size, context_length), device=device)
    return {"input_ids": ids, "labels": ids}
'''


def folder(tmp_path, kind: str):
    where = tmp_path / kind
    KINDS[kind][0]().save_pretrained(where)
    return where


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_folder_is_estimated_and_checked_with_no_python(tmp_path, kind):
    """fake device: the estimate writes the model's task and its config.json's hash; check rebuilds it from that."""
    where, out = folder(tmp_path, kind), tmp_path / "best.yaml"
    r = run_cli("estimate", where, "--budget", "4GiB", "--margin", "0", "--batch", "2", "--context", "16",
                "--out", out)
    assert r.exit_code == 0, r.output
    written = yaml.safe_load(out.read_text())["model"]
    assert written["source"] == kind and written["task"] == KINDS[kind][1]  # (relative to the config's folder)
    assert written["sha256"] == hashlib.sha256((where / "config.json").read_bytes()).hexdigest()
    r = run_cli("check", "--config", out)
    assert r.exit_code == 0 and "still fits" in r.output, r.output


def test_a_folder_with_lora_flags_is_the_model_file_that_builds_the_same(tmp_path, write_model):
    """fake device: the same parameters and the same peak, to the byte, as a model file building that model."""
    where = folder(tmp_path, "llama")
    source = api.what_if(write_model(LLAMA_FILE), 2, context=32, precision="bf16", checkpointing=True)
    made = open_model(ModelSection(source=str(where), lora=LoraSection(r=4)))
    assert made.section.lora.targets == ("q_proj", "v_proj") and made.section.lora.alpha == 8.0  # PEFT's defaults
    ours = api.what_if(made, 2, context=32, precision="bf16", checkpointing=True)
    assert ours.breakdown == source.breakdown and ours.breakdown.parameters_bytes > 0


def test_probe_check_train_from_a_folder_and_the_adapter_loads_onto_the_base(tmp_path):
    """cpu device: probe with LoRA flags, check the config, train two steps; the adapter saved in the run dir, put
    on the same base with PeftModel.from_pretrained, gives the trained model's outputs."""
    from peft import PeftModel

    where, out, run = folder(tmp_path, "llama"), tmp_path / "best.yaml", tmp_path / "run"
    r = run_cli("probe", where, "--device", "cpu", "--budget", "1GiB", "--batch", "2", "--context", "16",
                "--lora-r", "4", "--lora-targets", "q_proj,v_proj,o_proj", "--out", out)
    assert r.exit_code == 0, r.output
    config = load_config(out)
    assert config.model.lora.targets == ("q_proj", "v_proj", "o_proj") and config.model.lora.r == 4
    assert run_cli("check", "--config", out, "--device", "cpu").exit_code == 0
    r = run_cli("train", "--config", out, "--steps", "2", "--run-dir", run)
    assert r.exit_code == 0, r.output
    assert json.loads((run / "adapter" / "adapter_config.json").read_text())["r"] == 4
    trained = open_model(config.model, config_path=out).build()
    trained.load_state_dict(torch.load(sorted(run.glob("ckpt-*.pt"))[-1], weights_only=False)["model"])
    base = open_model(config.model.source, config_path=out).build()
    loaded = PeftModel.from_pretrained(base, run / "adapter")
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        want, got = trained.eval()(input_ids=ids).logits, loaded.eval()(input_ids=ids).logits
    lora_b = [p for n, p in trained.named_parameters() if "lora_B" in n]
    assert any(p.abs().sum() > 0 for p in lora_b)  # trained: B starts at zero, so an untrained adapter is no test
    torch.testing.assert_close(got, want)


def test_a_changed_config_json_is_refused_by_train_and_export_and_checked_as_it_is(tmp_path):
    where, out = folder(tmp_path, "gpt2"), tmp_path / "best.yaml"
    assert run_cli("estimate", where, "--budget", "4GiB", "--margin", "0", "--batch", "2", "--context", "16",
                   "--out", out).exit_code == 0
    raw = json.loads((where / "config.json").read_text())
    (where / "config.json").write_text(json.dumps({**raw, "n_layer": 3}))
    for command in (("train", "--config", out, "--steps", "1"), ("export", "--config", out, "--to", "hf")):
        one_line_error(run_cli(*command), "config.json of gpt2 has changed since", "model.sha256")
    assert not (tmp_path / "runs").exists()
    r = run_cli("check", "--config", out)  # the CI gate measures the model as it is now, and says it changed
    assert r.exit_code in (0, 1) and "config.json of gpt2 has changed since this config was written: checked as it " \
        "is now" in " ".join(r.output.split())


MODEL_WITH_ARGS = '''
import torch
from torch import nn

ARGS = {"n_layer": 2, "width": 16, "bias": True}

def build_model(n_layer, width, bias):
    return nn.Sequential(*[nn.Linear(width, width, bias=bias) for _ in range(n_layer)])

def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, context_length, 16, device=device)

def loss(model, batch):
    return model(batch).pow(2).mean()
'''


def test_a_model_files_args_are_given_recorded_and_rebuilt(tmp_path, write_model):
    """fake device: --model-arg over ARGS, typed as the default; check rebuilds the model the config records."""
    model, out = write_model(MODEL_WITH_ARGS), tmp_path / "best.yaml"
    r = run_cli("estimate", model, "--budget", "1GiB", "--margin", "0", "--batch", "2", "--context", "4",
                "--model-arg", "n_layer=5", "--model-arg", "bias=false", "--out", out)
    assert r.exit_code == 0, r.output
    config = load_config(out)
    assert config.model.args == {"n_layer": 5, "width": 16, "bias": False}
    rebuilt = open_model(config.model, config_path=out).build()
    assert len(rebuilt) == 5 and rebuilt[0].bias is None
    one_line_error(run_cli("estimate", model, "--budget", "1GiB", "--model-arg", "depth=3"),
                   "ARGS has no 'depth'", "bias, n_layer, width")
    one_line_error(run_cli("estimate", model, "--budget", "1GiB", "--model-arg", "n_layer=two"),
                   "--model-arg n_layer: expected int")


@pytest.mark.parametrize("case", ["no config.json", "unknown model_type", "task", "targets", "context", "hub"])
def test_bad_input_is_one_line(tmp_path, case):
    where = folder(tmp_path, "gpt2")
    args, needles = [where, "--budget", "1GiB"], []
    if case == "no config.json":
        (where / "config.json").unlink()
        needles = ["a folder with no config.json"]
    elif case == "unknown model_type":
        (where / "config.json").write_text(json.dumps({"model_type": "not-a-model"}))
        needles = ["model_type 'not-a-model'", "does not know"]
    elif case == "task":
        args, needles = args + ["--task", "seq2seq"], ["a gpt2 model cannot do --task seq2seq", "causal-lm"]
    elif case == "targets":
        args, needles = args + ["--lora-r", "2", "--lora-targets", "q_proj"], ["matches no layer", "c_attn"]
    elif case == "context":
        args, needles = args + ["--context", "4096"], ["--context 4096", "at most 128 tokens"]
    else:  # (a process of its own: huggingface_hub reads its settings once, when imported)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty-cache")}
        r = subprocess.run([sys.executable, "-m", "oomtune", "estimate", "hf:nobody/nothing", "--budget", "1GiB",
                            "--out", tmp_path / "x.yaml"], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [
            "error: hf:nobody/nothing: not in the Hugging Face cache and the Hub cannot be reached (no network or "
            "HF_HUB_OFFLINE=1): download it once, or give its local folder"], r.stderr
    if needles:
        one_line_error(run_cli("estimate", *args, "--out", tmp_path / "x.yaml"), *needles)
    assert not (tmp_path / "x.yaml").exists()


def test_a_full_fine_tune_leaves_a_model_folder_at_every_checkpoint_and_weights_are_loaded(tmp_path):
    """cpu device: a BERT classifier trained whole (no LoRA) from a folder with weights: train builds it from the
    folder's weights, and --save-adapter writes the save_pretrained folder at every checkpoint; it loads back as
    the trained model."""
    where, out, run = folder(tmp_path, "bert"), tmp_path / "best.yaml", tmp_path / "run"
    torch.manual_seed(1)
    saved = transformers.AutoModelForSequenceClassification.from_config(transformers.AutoConfig.from_pretrained(where))
    saved.save_pretrained(where)  # (weights other than the seed-0 build's)
    assert run_cli("estimate", where, "--budget", "4GiB", "--margin", "0", "--batch", "2", "--context", "16",
                   "--out", out).exit_code == 0
    assert load_config(out).model.task == "sequence-classification"
    built = open_model(load_config(out).model, config_path=out, load_weights=True).build()
    for name, value in saved.state_dict().items():
        torch.testing.assert_close(built.state_dict()[name], value)
    r = run_cli("train", "--config", out, "--steps", "2", "--checkpoint-interval", "1", "--save-adapter",
                "--run-dir", run)
    assert r.exit_code == 0, r.output
    assert r.output.count("model saved as Hugging Face does") == 2
    trained = torch.load(sorted(run.glob("ckpt-*.pt"))[-1], weights_only=False)["model"]
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(run / "model").state_dict()
    for name, value in trained.items():
        torch.testing.assert_close(loaded[name], value)
    assert not any(p.name.startswith(".model") for p in run.iterdir())  # (no half-written folder left)


def test_the_model_flags_a_launcher_passes_on_rebuild_the_same_section(tmp_path):
    """The flags the probe's launcher gives its ranks (model_flags) make the section they came from."""
    from oomtune.cli.model_options import model_flags, model_source

    section = model_source(str(folder(tmp_path, "llama")), "causal-lm", "bfloat16", True, 4, 6.0, 0.1,
                           "q_proj,o_proj")
    out = tmp_path / "best.yaml"
    r = run_cli("estimate", section.source, *model_flags(section), "--budget", "4GiB", "--margin", "0", "--batch",
                "2", "--context", "16", "--out", out)
    assert r.exit_code == 0, r.output
    recorded = load_config(out).model
    assert (recorded.task, recorded.dtype, recorded.padding, recorded.lora) == \
        (section.task, section.dtype, section.padding, section.lora)


@pytest.mark.parametrize("named", ["config.json", "folder"])
def test_an_estimate_again_replaces_its_own_config(tmp_path, named):
    """fake device: the config of a config.json (or a folder) is the same model's on the next run, not another's."""
    where, out = folder(tmp_path, "gpt2"), tmp_path / "best.yaml"
    model = where / "config.json" if named == "config.json" else where
    for _ in range(2):
        r = run_cli("estimate", model, "--budget", "4GiB", "--margin", "0", "--batch", "2", "--context", "16",
                    "--out", out)
        assert r.exit_code == 0, r.output
