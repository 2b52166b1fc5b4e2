"""Chunked cross-entropy (plan.chunked_loss, the `chunked-loss` rung): a Hugging Face causal LM's loss over 8 slices
of the sequence. devices: cpu (real compute, simulated memory) for the losses, fake for the estimate; the tensor
peak of the two equal to the byte.

Predicted saving, from the mechanism (levers/chunked_loss.py): Hugging Face's loss upcasts the whole logits to fp32,
and its backward's peak holds three whole fp32 tensors of the logits' size: the log-probabilities saved for
backward, their gradient, and the upcast logits' gradient. Chunked, the output layer runs on each slice and
backward consumes each slice's gradients before the next slice's are made: the saved log-probabilities are the same
(every slice's), but only one slice's two gradients exist at a time, so the peak drops by 2 x 7/8 of one fp32 copy
of the logits (B x T x V x 4 bytes), whatever the logits' own dtype (the 16-bit logits of amp and bf16-true exist
on neither path at that peak)."""

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


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-true"])
def test_same_loss_less_memory_as_predicted_and_fake_equals_cpu(wide_llama, precision):
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
    predicted = B * T * V * 4 * 2 * 7 / 8
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


def test_the_chunked_loss_is_transformers_own_with_ignored_labels_too(wide_llama):
    """cpu, real values: against the model's own loss (labels passed), with padding labels (-100) in the batch."""
    from oomtune.levers.chunked_loss import chunked_loss

    model_file = open_model(wide_llama)
    torch.manual_seed(0)
    model = model_file.build()
    ids = torch.randint(0, V, (3, 37))  # a length 8 does not divide: uneven slices
    labels = ids.clone()
    labels[0, 20:] = labels[2, :5] = -100
    own = model(input_ids=ids, labels=labels).loss
    ours = chunked_loss(model_file, model, {"input_ids": ids, "labels": labels})
    torch.testing.assert_close(ours, own, rtol=1e-5, atol=1e-6)


def test_only_transformers_shifted_cross_entropy_is_chunked():
    """GPT-2 and a LoRA Llama compute it; BART's decoder (unshifted labels), a mixture of experts adding its router's
    loss and PEFT prompt tuning (virtual tokens) do not, and each says why."""
    peft = pytest.importorskip("peft")
    import transformers as hf

    from oomtune.levers.chunked_loss import causal_lm_loss

    small = {"num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 64, "intermediate_size": 64}
    llama = hf.LlamaForCausalLM(hf.LlamaConfig(hidden_size=32, **small))
    assert causal_lm_loss(llama) is None
    assert causal_lm_loss(hf.GPT2LMHeadModel(hf.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))) is None
    assert causal_lm_loss(peft.get_peft_model(llama, peft.LoraConfig(r=2, target_modules=["q_proj"]))) is None
    bart = hf.BartForCausalLM(hf.BartConfig(d_model=32, decoder_layers=1, encoder_layers=1, vocab_size=64,
                                            decoder_attention_heads=2, encoder_attention_heads=2,
                                            decoder_ffn_dim=64, encoder_ffn_dim=64))
    assert causal_lm_loss(bart) == "its loss is not transformers' shifted cross-entropy (ForCausalLMLoss)"
    mixtral = hf.MixtralForCausalLM(hf.MixtralConfig(hidden_size=32, num_key_value_heads=2, num_local_experts=2,
                                                     output_router_logits=True, **small))
    assert causal_lm_loss(mixtral) == "its loss adds the router's auxiliary loss (output_router_logits)"
    prompt = peft.get_peft_model(hf.LlamaForCausalLM(hf.LlamaConfig(hidden_size=32, **small)),
                                 peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    assert causal_lm_loss(prompt) == "its PEFT adapter is prompt learning (virtual tokens lengthen the logits)"
    assert causal_lm_loss(torch.nn.Linear(2, 2)) == "it is not a Hugging Face model"


class _Named:
    label = "model.py"

    @staticmethod
    def user_code(what):
        import contextlib

        return contextlib.nullcontext()


def test_the_output_layer_runs_on_each_slice_where_the_forward_leaves_the_logits_alone():
    """cpu, real values. A Llama (PEFT LoRA-wrapped too) makes its logits with its output layer alone: the layer runs
    once a slice (its forward hooks once a slice, never on the hidden states) and the whole logits never exist.
    Gemma 2 soft-caps its logits after the layer: the whole logits are made and sliced, the same loss either way.
    A forward that raises leaves the model's own output layer in place."""
    peft = pytest.importorskip("peft")
    import transformers as hf

    from oomtune.levers.chunked_loss import CHUNKS, chunked_loss, sliced_head

    small = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
             "vocab_size": 64, "intermediate_size": 64}
    torch.manual_seed(0)
    llama = hf.LlamaForCausalLM(hf.LlamaConfig(**small))
    lora = peft.get_peft_model(hf.LlamaForCausalLM(hf.LlamaConfig(**small)),
                               peft.LoraConfig(r=2, target_modules=["q_proj"]))
    gemma = hf.Gemma2ForCausalLM(hf.Gemma2Config(head_dim=16, final_logit_softcapping=3.0, **small))
    assert sliced_head(llama) == (llama, "lm_head") and sliced_head(lora) == (lora.get_base_model(), "lm_head")
    assert sliced_head(gemma) is None
    ids = torch.randint(0, 64, (2, 24))
    for model in (llama, lora, gemma):
        head = model.get_output_embeddings()
        seen: list[tuple[int, ...]] = []
        handle = head.register_forward_hook(lambda mod, args, out, seen=seen: seen.append(tuple(out.shape)))
        own = model(input_ids=ids, labels=ids).loss
        seen.clear()
        ours = chunked_loss(_Named, model, {"input_ids": ids, "labels": ids})
        handle.remove()
        torch.testing.assert_close(ours, own, rtol=1e-5, atol=1e-6)
        assert seen == ([(2, 24 // CHUNKS, 64)] * CHUNKS if model is not gemma else [(2, 24, 64)]), seen

    def broken(*args, **kwargs):
        raise RuntimeError("the model file's bug")

    llama.model.forward = broken
    with pytest.raises(RuntimeError, match="the model file's bug"):
        chunked_loss(_Named, llama, {"input_ids": ids, "labels": ids})
    assert isinstance(llama.lm_head, torch.nn.Linear) and llama.get_output_embeddings() is llama.lm_head


def test_the_output_layer_is_sliced_only_where_the_logits_are_handed_on_as_they_are():
    """A forward that writes into its logits after the output layer (Chameleon masks its image tokens:
    `logits[:, :, ids] = ...`), a forward the model file set on the instance: no slicing (the whole logits, as the
    model makes them). Behind DDP (its `module`): sliced, as the estimate (which has no DDP wrapper) slices it."""
    import transformers as hf

    from oomtune.levers.chunked_loss import sliced_head

    class Masking(hf.LlamaForCausalLM):
        def forward(self, input_ids=None, **kwargs):
            hidden_states = self.model(input_ids=input_ids).last_hidden_state
            logits = self.lm_head(hidden_states)
            logits[:, :, 0] = -1e4  # (after the head: on the hidden states, a wrong loss or an IndexError)
            return hf.modeling_outputs.CausalLMOutputWithPast(logits=logits)

    class DistributedDataParallel(torch.nn.Module):  # (what dist.wrap.unwrapped recognises, without a process group)
        def __init__(self, module):
            super().__init__()
            self.module = module

    config = hf.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                            vocab_size=64, intermediate_size=64)
    assert sliced_head(Masking(config)) is None
    llama = hf.LlamaForCausalLM(config)
    assert sliced_head(DistributedDataParallel(llama)) == (llama, "lm_head")
    llama.forward = llama.forward  # (an instance attribute: the model file's own forward)
    assert sliced_head(llama) is None


def test_under_activation_offloading_the_output_layer_and_loss_keep_theirs_on_the_device(wide_llama):
    """device: cpu and fake. As torchtune's OffloadActivations leaves its output layer to the device and runs its loss
    outside it, what each slice's output layer and cross-entropy save stays on the device: host memory holds the
    model's activations, not one slice's logits (fp32 log-probabilities, 1 MiB a slice here; all 8 slices went to the
    host and back each step before, and torchtune's published LoRA run on Llama 3.2 3B came out 12% over the
    estimate)."""
    from oomtune.levers.chunked_loss import CHUNKS

    model_file = open_model(wide_llama)
    runs = {}
    for offload in (False, True):
        plan = Plan(B, T, "fp32", activation_checkpointing=True, chunked_loss=True, offload_activations=offload)
        torch.manual_seed(0)
        runs[offload] = cpu = run_trial(model_file, plan, CpuDevice("1GiB"))
        fake = run_trial(model_file, plan, FakeDevice("1GiB", margin=Margin()))
        assert (fake.peak_allocated_bytes, fake.host_peak_bytes) == (cpu.peak_allocated_bytes, cpu.host_peak_bytes)
    assert runs[True].loss == pytest.approx(runs[False].loss, rel=1e-6)
    slice_logits = B * T * V * 4 // CHUNKS
    assert 0 < runs[True].host_peak_bytes < slice_logits, runs[True].host_peak_bytes
