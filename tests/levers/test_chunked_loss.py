"""Chunked cross-entropy (plan.chunked_loss, the `chunked-loss` rung): a Hugging Face causal LM's loss over 8 slices
of the sequence. devices: cpu (real compute, simulated memory) for the losses, fake for the estimate; the tensor
peak of the two equal to the byte.

Predicted saving, from the mechanism (levers/chunked_loss.py): Hugging Face's loss upcasts the whole logits to fp32
and backward makes their fp32 gradient whole; chunked, one slice of each at a time, so the peak drops by 7/8 of
one fp32 copy of the logits (B x T x V x 4 bytes), and where the logits are 16-bit (amp, bf16-true) by the 16-bit
logits too (2 bytes an element), which Hugging Face's path holds beside its fp32 copies."""

from __future__ import annotations

import json
from importlib.util import find_spec

import pytest
import torch

from oomtune.config.export import export
from oomtune.config.loading import load_config
from oomtune.config.schema import Plan
from oomtune.memory.devices import CpuDevice, FakeDevice
from oomtune.memory.margin import Margin
from oomtune.models.source import open_model
from oomtune.search.trial import run_trial

from ..conftest import metrics, one_line_error, run_cli

pytestmark = pytest.mark.skipif(find_spec("transformers") is None, reason="transformers is not installed")

B, T, V = 4, 128, 4096  # a vocabulary large against the model: the logits are the step's largest tensors


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """A one-layer Llama whose logits dominate its memory (a Hugging Face folder: config.json, no weights)."""
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("wide-llama")
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, vocab_size=V, max_position_embeddings=256,
                architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("precision, logits_bytes", [("fp32", 0), ("bf16", 2), ("bf16-true", 2)])
def test_same_loss_less_memory_as_predicted_and_fake_equals_cpu(wide_llama, precision, logits_bytes):
    model_file = open_model(wide_llama)
    runs = {}
    for chunked in (False, True):
        plan = Plan(B, T, precision, chunked_loss=chunked)
        torch.manual_seed(0)  # the same weights and batch both ways
        cpu = run_trial(model_file, plan, CpuDevice("1GiB"))
        fake = run_trial(model_file, plan, FakeDevice("1GiB", margin=Margin()))
        assert fake.peak_allocated_bytes == cpu.peak_allocated_bytes  # to the byte
        runs[chunked] = cpu
    assert runs[True].loss == pytest.approx(runs[False].loss, rel=1e-5)  # float rounding only
    saved = runs[False].peak_allocated_bytes - runs[True].peak_allocated_bytes
    predicted = B * T * V * (4 * 7 / 8 + logits_bytes)
    print(f"{precision}: peak {runs[False].peak_allocated_bytes:,} -> {runs[True].peak_allocated_bytes:,} B, "
          f"saved {saved:,} B, predicted {predicted:,} B")
    assert saved == pytest.approx(predicted, rel=0.01)


def test_the_ladder_climbs_to_the_chunked_rung_and_training_runs_it(wide_llama, tmp_path):
    """Nothing fits on the usual rungs at this budget; the first rung past accumulation is chunked-loss (before
    bf16-true: it changes no value), the config records it, train runs it and export names torchtune's loss."""
    out = tmp_path / "best.yaml"
    r = run_cli("probe", wide_llama, "--device", "cpu", "--budget", "14MiB", "--batch", "8", "--context", "256",
                "--min-context", "256", "--out", out, "--json")
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    rungs = [x["rung"] for x in result["rungs"]]
    assert rungs[-1] == "chunked-loss" and "bf16-true" not in " ".join(rungs), rungs
    plan = load_config(out).plan
    assert plan.chunked_loss and plan.precision != "bf16-true"
    assert "chunked_loss: true" in out.read_text()
    train = run_cli("train", "--config", out, "--steps", "3", "--log-every-n-steps", "1", "--run-dir", tmp_path / "run")
    assert train.exit_code == 0, train.output
    losses = [row["loss"] for row in metrics(tmp_path / "run")]
    assert len(losses) == 3 and all(x == x for x in losses)
    assert "loss._component_=torchtune.modules.loss.CEWithChunkedOutputLoss" in export(plan, "torchtune").text()
    assert any(line.startswith("chunked_loss: compute the loss yourself") for line in export(plan, "hf").unexpressed)


def test_no_chunked_rung_where_the_model_file_has_its_own_loss_or_no_causal_lm(write_model, tmp_path):
    from ..conftest import TINY_MODEL

    own = write_model(TINY_MODEL + "\n\ndef loss(model, batch):\n    return model(*batch)\n", name="own_loss.py")
    plain = write_model(TINY_MODEL, name="plain.py")
    for path, why in ((own, "own_loss.py has its own loss(): chunking it is the loss's to do"),
                      (plain, "plain.py is not a Hugging Face causal LM with transformers' own loss (it is not a "
                              "Hugging Face model)")):
        r = run_cli("probe", path, "--device", "cpu", "--budget", "1MiB", "--batch", "8", "--context", "4", "--json",
                    "--out", tmp_path / f"{path.stem}.yaml")
        assert json.loads(r.stdout).get("levers_not_used", {}).get("chunked-loss", "").startswith(why), r.output
        # asked for it anyway (a what-if, or a config edited by hand): one line, never the model file's loss replaced
        r = run_cli("estimate", path, "--micro-batch", "2", "--context", "4", "--levers", "chunked-loss")
        one_line_error(r, f"plan.chunked_loss: {why}")
