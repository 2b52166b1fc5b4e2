"""What a Hugging Face folder's run takes in and gives out (issue 41): `train --data` (JSONL tokenized by the
folder's own tokenizer, packed to the plan's context, resumed exactly), `export --to hf` (the LoraConfig and the
BitsAndBytesConfig of the plan, as Python that builds them), and `oomtune init` (a model file that runs). Devices:
fake (estimate) and cpu (train)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from oomtune.config.loading import load_config

from ..conftest import metrics, one_line_error, run_cli
from .test_hf_folders import folder

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

WORDS = "the a cat dog sat on mat ran far and then slept".split()


def with_tokenizer(where):
    """A word-level tokenizer of WORDS saved into the folder, as a downloaded model's would be."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[EOS]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]").save_pretrained(
        where)
    return where


@pytest.fixture
def llama_config(tmp_path):
    """A LoRA plan for a tiny Llama folder with a tokenizer, estimated (fake device), and a JSONL file of 40 texts."""
    where, out = with_tokenizer(folder(tmp_path, "llama")), tmp_path / "best.yaml"
    r = run_cli("estimate", where, "--budget", "2GiB", "--margin", "0", "--batch", "4", "--context", "16",
                "--lora-r", "4", "--out", out)
    assert r.exit_code == 0, r.output
    rng = random.Random(0)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(20))}) + "\n"
                            for _ in range(40)))
    return out, data


def test_train_on_a_jsonl_file_and_resume_exactly(tmp_path, llama_config):
    """cpu device: 4 steps at once equal 2 steps, then a resume to 4, loss for loss; evaluation on the held-out
    tenth."""
    out, data = llama_config
    common = ["--config", out, "--data", data, "--eval-interval", "2", "--eval-steps", "1", "--log-every-n-steps", "1",
              "--warmup-steps", "0", "--lr", "1e-2", "--min-lr", "1e-2"]  # (one lr: the same at 2 steps as at 4)
    assert run_cli("train", *common, "--steps", "4", "--run-dir", tmp_path / "once").exit_code == 0
    assert run_cli("train", *common, "--steps", "2", "--run-dir", tmp_path / "twice").exit_code == 0
    r = run_cli("train", *common, "--steps", "4", "--run-dir", tmp_path / "twice", "--resume")
    assert r.exit_code == 0, r.output
    once, twice = metrics(tmp_path / "once"), metrics(tmp_path / "twice")
    assert [m["loss"] for m in once] == [m["loss"] for m in twice] and len(once) == 4
    assert [m.get("eval_loss") for m in once] == [m.get("eval_loss") for m in twice]
    assert once[1].get("eval_loss") is not None
    assert once[0]["loss"] != once[-1]["loss"]  # (trained: the adapters moved)


@pytest.mark.parametrize("case", ["empty", "not jsonl", "no text", "too short", "model file"])
def test_bad_data_is_one_line_and_nothing_is_written(tmp_path, llama_config, write_model, case):
    out, data = llama_config
    needles = {"empty": "holds no text", "not jsonl": "line 2 is not JSON", "no text": 'line 1 has no "text"',
               "too short": "make fewer than two sequences", "model file": "a model file gives its data"}[case]
    if case == "empty":
        data.write_text("\n")
    elif case == "not jsonl":
        data.write_text('{"text": "the cat"}\nthe dog\n')
    elif case == "no text":
        data.write_text('{"content": "the cat"}\n')
    elif case == "too short":
        data.write_text('{"text": "the cat sat"}\n')
    else:
        model = write_model()
        assert run_cli("estimate", model, "--budget", "1GiB", "--batch", "2", "--context", "4", "--out",
                       out := tmp_path / "file.yaml").exit_code == 0
    one_line_error(run_cli("train", "--config", out, "--data", data, "--run-dir", tmp_path / "run"), needles)
    assert not (tmp_path / "run").exists()


def test_export_to_hf_writes_the_lora_and_nf4_configs_that_build_the_model(tmp_path, llama_config):
    """The lines `export --to hf` asks to set in code are Python that builds the real PEFT and transformers
    configs, with the config's LoRA settings and the plan's NF4 compute dtype."""
    import dataclasses

    import torch

    from oomtune.config.writing import save_config

    out, _ = llama_config
    config = load_config(out)
    save_config(dataclasses.replace(config, plan=dataclasses.replace(config.plan, precision="bf16-true",
                                                                     nf4_frozen_weights=True)), out)
    r = run_cli("export", "--config", out, "--to", "hf")
    assert r.exit_code == 0, r.output
    lines = {line.split(": ", 2)[1]: line.split(": ", 2)[2] for line in r.stderr.splitlines()
             if line.startswith("set in your code: ")}
    lora = eval(lines["lora"].removeprefix("peft.get_peft_model(model, ").removesuffix(")"),  # noqa: S307
                {"LoraConfig": peft.LoraConfig})
    assert (lora.r, lora.lora_alpha, sorted(lora.target_modules), lora.task_type) == (4, 8, ["q_proj", "v_proj"],
                                                                                       "CAUSAL_LM")
    quantized = lines["nf4_frozen_weights"].split("quantization_config=", 1)[1].rsplit(")", 1)[0]
    bnb = eval(quantized, {"BitsAndBytesConfig": transformers.BitsAndBytesConfig, "torch": torch})  # noqa: S307
    assert bnb.load_in_4bit and bnb.bnb_4bit_quant_type == "nf4" and bnb.bnb_4bit_compute_dtype == torch.bfloat16
    assert json.loads(r.stdout)["per_device_train_batch_size"] == config.plan.micro_batch_size


@pytest.mark.parametrize("start", ["plain", "folder"])
def test_init_writes_a_model_file_that_estimates(tmp_path, start):
    """fake device: the template imports, keeps the contract, and its ARGS take --model-arg; never written over."""
    target = tmp_path / "mine.py"
    args = ["init", "--out", target] if start == "plain" else ["init", folder(tmp_path, "llama"), "--out", target]
    r = run_cli(*args)
    assert r.exit_code == 0 and target.is_file(), r.output
    arg = "n_layer=2" if start == "plain" else "num_hidden_layers=1"
    r = run_cli("estimate", target, "--budget", "2GiB", "--margin", "0", "--batch", "2", "--context", "8",
                "--model-arg", arg, "--out", tmp_path / "mine.yaml")
    assert r.exit_code == 0, r.output
    assert load_config(tmp_path / "mine.yaml").model.args[arg.split("=")[0]] == int(arg.split("=")[1])
    one_line_error(run_cli(*args), "exists: not overwriting it")


def test_a_resume_on_other_data_and_a_users_adapter_folder_are_refused(tmp_path, llama_config):
    """cpu device: --resume with another --data file (other tokens) is one line and exit 2, the run dir left as it
    was; an adapter/ folder of the user's in a new run dir is never replaced."""
    out, data = llama_config
    run = tmp_path / "run"
    assert run_cli("train", "--config", out, "--data", data, "--steps", "1", "--run-dir", run).exit_code == 0
    before = sorted(p.name for p in run.iterdir())
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"text": " ".join(reversed(WORDS * 3))}) + "\n" for _ in range(40)))
    one_line_error(run_cli("train", "--config", out, "--data", other, "--steps", "2", "--run-dir", run, "--resume"),
                   "its tokens are not those", "ckpt-00000001.pt")
    assert sorted(p.name for p in run.iterdir()) == before
    mine = tmp_path / "mine"
    (mine / "adapter").mkdir(parents=True)
    (mine / "adapter" / "notes.txt").write_text("mine")
    one_line_error(run_cli("train", "--config", out, "--steps", "1", "--run-dir", mine),
                   "holds adapter/, which oomtune did not write")
    assert (mine / "adapter" / "notes.txt").read_text() == "mine"


def test_a_model_files_string_args_survive_the_config(tmp_path, write_model):
    """fake device: an ARGS string that reads as a number ('2', '1e-3') is written and read back as a string."""
    model = write_model('''
import torch
from torch import nn

ARGS = {"tag": "v1", "width": 8}

def build_model(tag, width):
    assert isinstance(tag, str), tag
    return nn.Linear(width, width)

def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, 8, device=device)

def loss(model, batch):
    return model(batch).pow(2).mean()
''')
    out = tmp_path / "best.yaml"
    assert run_cli("estimate", model, "--budget", "1GiB", "--margin", "0", "--batch", "2", "--context", "1",
                   "--model-arg", "tag=1e-3", "--out", out).exit_code == 0
    assert load_config(out).model.args == {"tag": "1e-3", "width": 8}
    r = run_cli("check", "--config", out)
    assert r.exit_code == 0, r.output


def test_an_eval_batch_holds_its_own_tokens_not_the_whole_data(tmp_path):
    """cpu device: an eval batch was a slice of the packed data, a view of every sequence's storage, which the
    simulated device counted while the trainer kept the batch: after the first evaluation a run's steps peaked that
    much over the plan's probe (78,848 B for a 77-sequence file). Each batch now owns its tokens, as a train batch
    (gathered) and a batch copied to a GPU do."""
    from oomtune.models.text_data import PackedText

    where = with_tokenizer(tmp_path / "tok")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(WORDS)}) + "\n" for _ in range(40)))
    packed = PackedText(data, transformers.AutoTokenizer.from_pretrained(str(where)), 64, 16)
    assert len(packed.eval) >= 2
    for hook in (packed.eval_batches, packed.train_batches):
        ids = next(hook(1, 16, torch.device("cpu")))["input_ids"]
        assert ids.untyped_storage().nbytes() == ids.numel() * ids.element_size() == 16 * 8
