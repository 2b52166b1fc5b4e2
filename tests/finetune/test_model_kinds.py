"""Model files of the kinds fine-tuning users bring (tests/finetune/models): a PEFT LoRA Hugging Face Llama, a
build_model() that calls .to(), one that puts its model on "cuda" unconditionally, a BERT fed an attention mask, a
LoRA BERT classifier (PEFT deep-copies its head), a T5, a compiled model, a top-1 MoE routing tokens with
nonzero and a LoHa Llama (its adapters branch on a random draw). Each runs probe (device: cpu), train for 3 steps
(cpu), estimate (fake) and check (fake) and exits 0, and the fake device's tensor peak for the probe's plan is the
cpu device's to the byte: the code paths are the same (the MoE's shapes depend on its weights, so the fake device
computes it on the cpu and says so)."""

from __future__ import annotations

import json
import shutil
from importlib.util import find_spec
from pathlib import Path

import pytest

from oomtune.config.loading import load_config
from oomtune.memory.tracker import rounded
from oomtune.model_file import block_stacks, load_model_file

from ..conftest import metrics, run_cli

# a mark, not importorskip: importing peft takes ~10 s, and every pytest worker would pay it collecting this file
pytestmark = pytest.mark.skipif(find_spec("transformers") is None or find_spec("peft") is None,
                                reason="transformers and peft are not installed (pip install -e '.[dev]')")

MODELS = Path(__file__).parent / "models"
KINDS = ["hf_llama_lora", "moved", "to_cuda", "hf_bert_mask", "hf_bert_lora_cls", "hf_t5", "compiled",
         "moe_nonzero", "hf_llama_loha", "hf_gpt2_prefix", "llama3_scaled_rope", "optimizer_in_backward"]
BUDGET = ("--budget", "64MiB")
# cpu and fake accounting alike: the generic card's rules (CUDA autocast and attention), and its margin (a 512 MiB
# context assumed, 16.25 MiB of cuBLAS workspaces, the allocator modelled): about the 58 MiB that 64 MiB less 10%
# headroom left for tensors without a card
AS_A_CARD = ("--gpu", "generic", "--budget", "650MiB")


def _probe_train_estimate_check(kind: str, tmp_path: Path) -> tuple[dict, dict, dict, str]:
    model = MODELS / f"{kind}.py"
    probe = run_cli("probe", model, "--device", "cpu", *AS_A_CARD, "--out", tmp_path / "best.yaml", "--json")
    assert probe.exit_code == 0, probe.output
    train = run_cli("train", "--config", tmp_path / "best.yaml", "--steps", "3", "--log-every-n-steps", "1",
                    "--run-dir", tmp_path / "run")
    assert train.exit_code == 0, train.output
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2, 3]
    estimate = run_cli("estimate", model, *AS_A_CARD, "--out", tmp_path / "est.yaml", "--json")
    assert estimate.exit_code == 0, estimate.output
    check = run_cli("check", "--config", tmp_path / "best.yaml", "--json")  # fake, the card the probe accounted by
    assert check.exit_code == 0, check.output
    return json.loads(probe.stdout), json.loads(estimate.stdout), json.loads(check.stdout), train.output


COMPUTED = ("moe_nonzero.py: aten.nonzero has an output that depends on tensor values (data-dependent), which fake "
            "tensors do not have, so it was measured on real tensors computed on the cpu (the same tracker and "
            "margin; slower, and it needs the RAM)")
EAGER = "compiled.py: build_model() compiles its model (torch.compile); torch.compile does not run under the "


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_probes_trains_estimates_and_checks_and_fake_equals_cpu(kind, tmp_path):
    """Where a kind measures differently from what one would assume, the output says so: the MoE (estimate and
    check computed on the cpu), the compiled model (probe, its config, check and train: traced as --compile traces,
    since Dynamo runs nothing under the tracker)."""
    probed, estimated, checked, trained = _probe_train_estimate_check(kind, tmp_path)
    print(f"{kind}: plan {probed['plan']}, cpu peak {probed['peak_bytes']}, fake {estimated['peak_bytes']}, "
          f"check {checked['new_peak_bytes']}; notes {estimated['notes'] + checked['notes']}")
    assert estimated["plan"] == probed["plan"]
    assert estimated["peak_bytes"] == probed["peak_bytes"] == checked["new_peak_bytes"]  # to the byte
    computed = [n for n in estimated["notes"] + checked["notes"] if "computed on the cpu" in n]
    assert computed == ([COMPUTED, COMPUTED] if kind == "moe_nonzero" else [])  # only it needs missing values
    grouped = [n for n in probed["notes"] + estimated["notes"] + checked["notes"]
               if "with grouped query heads (4 query, 2" in n]
    assert len(grouped) == (3 if kind in ("hf_llama_lora", "hf_llama_loha") else 0)  # fp32 attention: math's
    eager = [n for n in probed["notes"] + estimated["notes"] + checked["notes"] if n.startswith(EAGER)]
    assert len(eager) == (3 if kind == "compiled" else 0)
    if kind == "compiled":
        own = [n for n in probed["notes"] if not n.startswith("threads: ")]
        assert EAGER + "cpu device's memory tracker, so the model is traced as --compile traces" in own[-1]
        assert EAGER + "fake device's memory tracker" in checked["notes"][0]
        assert load_config(tmp_path / "best.yaml").found_by.notes == tuple(probed["notes"])
        assert "it trains through that trace here" in " ".join(trained.split())
        assert " ex/s " in trained and "tok/s" not in trained  # context 1: its speed counts examples




def test_the_probes_prior_never_computes_a_model_whose_shapes_need_values():
    """devices: cpu, and fake for the prior. The MoE's routing needs tensor values: the prior (which stands in for a
    GPU) reports that it has none instead of training the model on the host, and the cpu device searches alone."""
    import oomtune

    result = oomtune.probe(MODELS / "moe_nonzero.py", device="cpu", gpu="generic", budget="650MiB", batch=8,
                           prior=True)
    assert result.prior.trials == 0 and "aten.nonzero" in result.prior.missing
    assert result.plan is not None
    assert not any("computed on the cpu" in n for n in result.notes)


def test_a_frozen_base_has_no_gradients_or_optimizer_state_and_tied_weights_count_once():
    """device: fake (static memory). LoRA: gradients and AdamW's two moments for the adapters only. moved.py: its
    head is its embedding (counted once), its frozen block has none."""
    from oomtune.memory.breakdown import static_memory

    for kind in ("hf_llama_lora", "moved"):
        mf = load_model_file(MODELS / f"{kind}.py")
        model = mf.build()  # real tensors, for the expected counts
        unique = {id(p): p for p in model.parameters()}.values()
        trainable = [p for p in unique if p.requires_grad]
        assert len(trainable) < len(unique)
        static = static_memory(mf)
        assert static.weights_bytes == sum(rounded(p.numel() * 4) for p in unique) + \
            sum(rounded(b.numel() * b.element_size()) for b in model.buffers())
        assert static.gradients_bytes == sum(rounded(p.numel() * 4) for p in trainable)
        moments = 2 * static.gradients_bytes
        assert moments <= static.optimizer_bytes <= moments + len(trainable) * 512  # + a step count per tensor
    assert model.head.weight is model.embed.weight


def test_the_fake_device_sees_the_attention_mask_real_tensors_give(monkeypatch):
    """devices: cpu and fake. Inside BERT's first attention, the mask is what real tensors make of the batch's:
    none for an all-ones mask (transformers drops it, SDPA masks nothing), and the same 4-D mask where rows are
    padded. Fails if fake tensors take another code path (they once kept a (B, 1, T, T) fp32 mask per layer)."""
    from oomtune.config.schema import Plan
    from oomtune.memory.devices import CpuDevice, make_device
    from oomtune.search.trial import run_trial

    def seen_mask(mf, device) -> tuple | None:
        seen = []

        def observe(t, phase):
            if phase == "forward" and not seen:
                attention = t.model.bert.encoder.layer[0].attention.self
                attention.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("attention_mask")),
                                                    with_kwargs=True)

        run_trial(mf, Plan(2, 32), device, observe=observe)
        mask = seen[0]
        return None if mask is None else (tuple(mask.shape), mask.dtype)

    for pad_from in (None, 24):
        monkeypatch.setenv("PAD_FROM", "" if pad_from is None else str(pad_from))
        mf = load_model_file(MODELS / "hf_bert_mask.py")
        real, fake = seen_mask(mf, CpuDevice("1GiB")), seen_mask(mf, make_device("fake", "1GiB"))
        print(f"padding from {pad_from}: the first attention sees {real} on cpu, {fake} on fake")
        assert fake == real
        assert (real is None) == (pad_from is None)


def test_a_lora_checkpoint_resumes_the_run_exactly(tmp_path):
    """device: cpu. LoRA adapters and their AdamW state come back from the step-2 checkpoint: steps 3-4 are the
    uninterrupted run's, loss for loss."""
    model = MODELS / "hf_llama_lora.py"
    assert run_cli("probe", model, "--device", "cpu", *BUDGET, "--out", tmp_path / "best.yaml").exit_code == 0
    args = ("train", "--config", tmp_path / "best.yaml", "--steps", "4", "--checkpoint-interval", "2",
            "--log-every-n-steps", "1", "--lr", "0.01")
    assert run_cli(*args, "--run-dir", tmp_path / "whole").exit_code == 0
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    (tmp_path / "resumed" / "ckpt-00000004.pt").unlink()
    r = run_cli(*args, "--run-dir", tmp_path / "resumed", "--resume")
    assert r.exit_code == 0, r.output
    whole, resumed = metrics(tmp_path / "whole"), metrics(tmp_path / "resumed")
    assert [m["loss"] for m in resumed] == [m["loss"] for m in whole]
    assert whole[0]["loss"] != whole[-1]["loss"]  # the adapters trained


def test_t5s_two_block_stacks_are_both_found_and_hf_checkpointing_works_through_peft():
    mf = load_model_file(MODELS / "hf_t5.py")
    stacks = block_stacks(mf.build())
    assert [(type(s[0]).__name__, len(s)) for s in stacks] == [("T5Block", 2), ("T5Block", 2)]
    lora = load_model_file(MODELS / "hf_llama_lora.py")
    model = lora.build()
    lora.enable_checkpointing(model)
    assert model.base_model.model.model.layers[0].gradient_checkpointing


LIBRARY_WARNING = """
import logging

import torch
from transformers import LlamaConfig, LlamaForCausalLM

def build_model():
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config)
    assert hasattr(type(model), "is_gradient_checkpointing"), "transformers dropped the alias: warn another way"
    model.is_gradient_checkpointing  # transformers' deprecated alias warns (peft 0.21 read it in get_peft_model)
    # what bitsandbytes 0.50 logs when it is imported on a CPU with AVX512-BF16 and no kernel comes (here on any CPU)
    logging.getLogger("bitsandbytes.backends.cpu.ops").warning("Failed to load CPU gemm_4bit_forward: %s", "none")
    return model

def make_batch(batch_size, context_length, device):
    ids = torch.randint(0, 256, (batch_size, context_length), device=device)
    return {"input_ids": ids, "labels": ids}
"""


def test_library_warnings_show_only_with_debug(tmp_path):
    """device: fake. A library's warning (transformers' FutureWarning on a renamed attribute, read in build_model
    as peft 0.21's get_peft_model read it; peft 0.22 reads it no more, and a fresh install failed here) and a record
    on a library module's logger (bitsandbytes' on a CPU with AVX512-BF16, shown by every command: the filter was
    on the library's top logger only) are not shown by every command; --debug shows them. Run as a user runs it, in
    a process of its own."""
    import os
    import subprocess
    import sys

    model = tmp_path / "warns.py"
    model.write_text(LIBRARY_WARNING)
    args = [sys.executable, "-m", "oomtune", "estimate", str(model), *BUDGET, "--margin", "0", "--micro-batch", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    loud = subprocess.run([*args, "--debug"], capture_output=True, text=True, env=env, cwd=tmp_path)
    quiet = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert loud.returncode == quiet.returncode == 0, (loud.stderr + quiet.stderr)[-2000:]
    assert "is_gradient_checkpointing` is deprecated" in loud.stderr, loud.stderr[-2000:]
    assert "is_gradient_checkpointing" not in quiet.stderr, quiet.stderr[-2000:]
    assert "Failed to load CPU gemm_4bit_forward: none" in loud.stderr, loud.stderr[-2000:]
    assert "gemm_4bit" not in quiet.stderr, quiet.stderr[-2000:]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_hf_mixtral_measures_on_fake_tensors_as_on_the_cpu(precision):
    """device: fake and cpu. Its experts' grouped matmul in fp32 failed on fake tensors alone ("Expected inputs of
    BF16 type", exit 2, the model blamed), so estimate and check could not run a model that probes and trains."""
    from oomtune.config.schema import Plan
    from oomtune.memory.devices import CpuDevice, FakeDevice
    from oomtune.memory.margin import Margin
    from oomtune.search.trial import run_trial

    model_file = load_model_file(MODELS / "hf_mixtral_lora.py")
    plan = Plan(2, 16, precision)
    cpu = run_trial(model_file, plan, CpuDevice("1GiB"))
    fake = run_trial(model_file, plan, FakeDevice("1GiB", margin=Margin()))
    assert not cpu.oom and not fake.oom
    assert fake.phase_peaks["forward"] == cpu.phase_peaks["forward"]
    assert fake.peak_allocated_bytes == cpu.peak_allocated_bytes


@pytest.mark.parametrize("card", [None, "generic"])
def test_a_mask_made_from_float_ones_takes_the_same_path_on_fake_tensors(card):
    """devices: cpu and fake. BART's decoder makes its attention mask with torch.ones (float32); transformers reads
    it, finds it all ones and takes SDPA's causal path with no mask. The fake device kept no values for float
    factories: it built the (B, 1, T, T) masks, 256 KiB more in forward and backward at micro-batch 8, context 64."""
    from oomtune.config.schema import Plan
    from oomtune.memory.cards import find_gpu
    from oomtune.memory.devices import CpuDevice, FakeDevice
    from oomtune.memory.margin import Margin
    from oomtune.search.trial import run_trial

    model_file = load_model_file(MODELS / "hf_bart_lora.py")
    gpu = find_gpu(card) if card else None
    plan = Plan(8, 64, "fp32")
    cpu = run_trial(model_file, plan, CpuDevice("1GiB", gpu, Margin()))
    fake = run_trial(model_file, plan, FakeDevice("1GiB", gpu=gpu, margin=Margin()))
    assert not cpu.oom and not fake.oom
    for phase in ("forward", "backward", "optimizer"):
        assert fake.phase_peaks[phase] == cpu.phase_peaks[phase], phase


def test_a_model_that_checkpoints_itself_gets_no_checkpointing_rung(tmp_path):
    """device: fake (estimate). build_model() turned the Hugging Face model's own checkpointing on: a checkpointing
    rung would measure every size again for the same peaks (5 of 16 trials on a cpu probe of it without LoRA), so
    the ladder has none and says why; asking for --checkpointing is refused with the reason. The same model built
    without the switch keeps its rung."""
    from oomtune.memory.breakdown import static_memory

    model = MODELS / "hf_self_checkpointing.py"
    static = static_memory(load_model_file(model))
    assert static.checkpoints_itself and not static.checkpointing_supported
    r = run_cli("estimate", model, "--budget", "6MiB", "--margin", "0", "--out", tmp_path / "e.yaml", "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert [rung["rung"] for rung in report["rungs"]][:2] == ["fp32", "amp"]
    assert not any(rung["activation_checkpointing"] for rung in report["rungs"])
    assert ("no activation checkpointing rung: hf_self_checkpointing.py's build_model() turns the model's own "
            "activation checkpointing on (GPT2Model.gradient_checkpointing is True), so every rung runs checkpointed "
            "already") in report["notes"]
    what_if = run_cli("estimate", model, "--budget", "6MiB", "--micro-batch", "2", "--checkpointing")
    assert what_if.exit_code == 2
    assert "build_model() turns the model's own activation checkpointing on (GPT2Model" in what_if.output
    plain = tmp_path / "plain.py"  # the same file without the switch
    plain.write_text(model.read_text().replace("    model.gradient_checkpointing_enable(", "    dict(", 1))
    static = static_memory(load_model_file(plain))
    assert static.checkpointing_supported and static.checkpoints_itself is None


@pytest.mark.parametrize("pad_from", [None, "100"])
def test_an_all_ones_attention_mask_is_noted_as_the_path_transformers_skips(monkeypatch, pad_from):
    """device: cpu (make_batch's values). transformers drops an all-ones attention_mask and runs attention unmasked;
    a padded batch builds the mask and takes a costlier path (this BERT's tensor peak: 25.65 MiB against 30.65 MiB
    at micro-batch 16, context 256, bf16, on an RTX 3060's rules, +20%). The probe says so where make_batch's mask
    is all ones, and not where it pads."""
    from oomtune.memory.devices import CpuDevice
    from oomtune.search.batch_notes import batch_notes

    if pad_from is not None:
        monkeypatch.setenv("PAD_FROM", pad_from)
    notes = batch_notes(load_model_file(MODELS / "hf_bert_mask.py"), CpuDevice("1GiB"), 128)
    said = [n for n in notes if "gives an attention_mask of all ones, which transformers drops" in n]
    assert len(said) == (pad_from is None), notes


def test_prefix_tuning_has_no_checkpointing_rung_and_a_checkpointed_plan_is_one_line(tmp_path):
    """PEFT prefix tuning cannot train checkpointed (a Hugging Face model checkpointed in training runs without
    the key/value cache its prefix is): the ladder leaves the rung out and says why, where its trials failed with
    a shape error and stopped the estimate; a plan that asks for it is one line, exit 2."""
    model = MODELS / "hf_gpt2_prefix.py"
    out = tmp_path / "best.yaml"
    r = run_cli("estimate", model, "--budget", "3MiB", "--margin", "0", "--batch", "8", "--levers",
                "checkpointing,accumulation", "--out", out, "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert not [t for t in report["trials"] if t["activation_checkpointing"]] and report["trials"]
    assert any(n.startswith("no activation checkpointing rung: hf_gpt2_prefix.py cannot train checkpointed (PEFT "
                            "prefix tuning") for n in report["notes"])
    out.write_text(out.read_text().replace("activation_checkpointing: false", "activation_checkpointing: true"))
    checked = run_cli("check", "--config", out)
    assert checked.exit_code == 2, checked.output
    assert "plan.activation_checkpointing: hf_gpt2_prefix.py cannot train checkpointed" in checked.stderr
    assert len(checked.stderr.strip().splitlines()) == 1


def test_an_hf_model_that_has_no_checkpointing_of_its_own_gets_the_rung_on_its_stages():
    """device: fake. ConvNext (ResNet, EfficientNet...): transformers' switch raises for it (supports_gradient_
    checkpointing False), and the probe stopped at the checkpointing rung, exit 2, no config, blaming the model file
    (from a new user's pass). Its stages, the longest ModuleList, are wrapped instead, and save memory."""
    from oomtune.api import what_if
    from oomtune.checkpointing import hf_checkpointing
    from oomtune.memory.breakdown import static_memory

    mf = load_model_file(MODELS / "hf_convnext.py")
    assert hf_checkpointing(mf.build()) is None and static_memory(mf).checkpointing_supported
    plain, checkpointed = (what_if(mf, 16, budget="1GiB", margin="0", precision="bf16", checkpointing=ckpt)
                           for ckpt in (False, True))
    assert checkpointed.breakdown.peak_bytes < plain.breakdown.peak_bytes


def test_a_layer_drop_model_is_measured_running_every_layer_and_the_probe_says_so(write_model):
    """device: cpu. Wav2Vec2 skips layers at random in training (LayerDrop): each trial measured the layers its dice
    kept, so a larger micro-batch read a lower peak and the plan trained past the limit (from a new user's pass).
    Every trial now runs them all: the same peak as the model without LayerDrop, every time; the model's own
    setting is put back after the trial (training keeps it), and the notes say so."""
    from oomtune.config.schema import Plan
    from oomtune.memory.breakdown import static_memory
    from oomtune.memory.devices import CpuDevice
    from oomtune.memory.layer_drop import every_layer, layer_drops
    from oomtune.search.trial import run_trial

    source = (MODELS / "hf_wav2vec2_layerdrop.py").read_text()
    mf, without = (load_model_file(MODELS / "hf_wav2vec2_layerdrop.py"),
                   load_model_file(write_model(source.replace("LAYERDROP = 0.5", "LAYERDROP = 0.0"))))
    plan = Plan(4, 64, "fp32", False, 1)
    peaks = [run_trial(mf, plan, CpuDevice("1GiB")).peak_bytes for _ in range(4)]
    assert peaks == [run_trial(without, plan, CpuDevice("1GiB")).peak_bytes] * 4
    model = mf.build()
    with every_layer(model):
        assert layer_drops(model) == []
    assert [(name, p) for _, name, p in layer_drops(model)] == [("layerdrop", 0.5)]
    assert static_memory(mf).layer_drop == (
        "hf_wav2vec2_layerdrop.py skips layers at random in training (layerdrop 0.5 on Wav2Vec2Config): every trial "
        "runs all of them, the worst case, so training's peaks stay at or under the measured ones")
    assert static_memory(without).layer_drop is None


def test_a_what_if_plan_says_when_grouped_heads_send_fp32_attention_to_math():
    """device: fake, with the generic card's rules. The Llama's 4 query heads share 2 key/value heads: fp32
    attention is math's on a card (the note); in bf16 flash takes it (no note)."""
    args = ("estimate", MODELS / "hf_llama_lora.py", *AS_A_CARD, "--micro-batch", "2", "--json")
    fp32, bf16 = run_cli(*args), run_cli(*args, "--precision", "bf16")
    assert fp32.exit_code == bf16.exit_code == 0, fp32.output + bf16.output
    grouped = [[n for n in json.loads(r.stdout)["notes"] if "attention with grouped query heads" in n]
               for r in (fp32, bf16)]
    assert len(grouped[0]) == 1 and grouped[1] == []
