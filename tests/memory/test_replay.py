"""Replaying a trial's memory at another micro-batch from two traced trials (memory/replay.py): the trace's
bookkeeping and the lines without torch, then (device: fake, the prior's) a replay against the fake trial it
stands for, to the byte, on models of every kind and on a card profile."""

from __future__ import annotations

import dataclasses
from importlib.util import find_spec
from pathlib import Path

import pytest

from oomtune.config.schema import Plan
from oomtune.memory.allocator import CachingAllocatorModel
from oomtune.memory.cards import find_gpu
from oomtune.memory.devices import CpuDevice
from oomtune.memory.margin import Margin
from oomtune.memory.replay import Lines, Trace, replay
from oomtune.model_file import load_model_file
from oomtune.search.prior import prior_device
from oomtune.search.trial import run_trial

from ..conftest import EXAMPLES

MiB = 1 << 20
FINETUNE = Path(__file__).parent.parent / "finetune" / "models"


def test_a_trace_numbers_storages_by_birth_even_where_an_id_is_reused_and_sorts_a_run_of_frees():
    """Keys are storage ids, which a storage born after another died may reuse: each birth gets a new number. A run
    of frees (a graph released at once, in an order that follows ids) is kept in order of birth."""
    events = [("set", 900, 10), ("set", 901, 20), ("set", 902, 30), ("mark", "forward"), ("free", 902),
              ("free", 900), ("set", 900, 40), ("set", 900, 4000), ("free", 901), ("free", 900), ("mark", None)]
    t = Trace.of([(77, 512)], events)
    assert t.initial == (512,)
    assert t.events == (("set", 1, 10), ("set", 2, 20), ("set", 3, 30), ("mark", "forward"), ("free", 1),
                        ("free", 3), ("set", 4, 40), ("set", 4, 4000), ("free", 2), ("free", 4), ("mark", None))
    assert not t.hosted
    host = Trace.of([(77, 512)], [("set", 1, 8), ("host", 5, 100), ("host", 5, 700), ("free", 1), ("hfree", 5),
                                  ("hfree", 6)], host_initial=[(6, 1024)])
    assert host.hosted and host.host_initial == (1024,)
    assert host.events == (("set", 2, 8), ("hset", 3, 100), ("hset", 3, 700), ("hfree", 1), ("free", 2),
                           ("hfree", 3))  # (a run of frees in order of birth, whichever memory)


def _trace(per_sample: int, batch: int, layout_copy: bool = False) -> Trace:
    """Weights (1 KiB, batch-independent), an activation of per_sample bytes a sample, a scalar loss; at batch 1 a
    model whose input slice is already contiguous makes no copy (`layout_copy` False there)."""
    events = [("set", 1, 1024), ("mark", "forward"), ("set", 2, per_sample * batch)]
    if layout_copy:
        events += [("set", 3, per_sample * batch), ("free", 3)]
    events += [("set", 4, 4), ("mark", "backward"), ("free", 2), ("mark", None)]
    return Trace.of([], events)


def test_lines_through_two_traces_and_where_they_do_not_line_up():
    a, b = _trace(3000, 2), _trace(3000, 10)
    lines = Lines.through(a, 2, b, 10)
    assert lines.events[2] == ("set", 1, 0, 3000) and lines.events[0] == ("set", 0, 1024, 0)
    assert Lines.through(a, 2, a, 2) is None  # one micro-batch is not a line
    assert Lines.through(_trace(3000, 1), 1, _trace(3000, 10, layout_copy=True), 10) is None  # not the same ops
    odd = Trace.of([], [("set", 1, 1024), ("mark", "forward"), ("set", 2, 3000 * 10 + 5), ("set", 4, 4),
                        ("mark", "backward"), ("free", 2), ("mark", None)])
    assert Lines.through(a, 2, odd, 10) is None  # not a whole number of bytes a sample


def test_storages_in_host_memory_are_replayed_on_lines_and_counted_apart():
    """The offload levers' host storages: on lines as the device's are, in the host's peak, not the device's count
    nor its allocator model."""
    def traced(batch: int, host_initial=((9, 2048),)) -> Trace:
        return Trace.of([], [("set", 1, 1024), ("mark", "forward"), ("host", 2, 4096 * batch), ("set", 3, 100),
                             ("hfree", 2), ("host", 4, 512), ("mark", None)], host_initial=list(host_initial))

    lines = Lines.through(traced(2), 2, traced(4), 4)
    assert lines is not None and lines.host_initial == (2048,)
    r = replay(lines, 7, CachingAllocatorModel(), Margin().total)
    assert r.host_peak_bytes == 2048 + 4096 * 7
    assert r.peak_allocated_bytes == 1024 + 512  # the host's bytes are not the device's
    assert Lines.through(traced(2), 2, traced(4, host_initial=()), 4) is None  # another host start
    assert traced(7).host_peak() == r.host_peak_bytes  # counted on the host's events alone, as replayed
    crossed = Lines((), (("set", 0, 1024, 0), ("hfree", 0), ("mark", None)), (1, 2))  # a device storage freed as
    assert replay(crossed, 3, CachingAllocatorModel(), Margin().total) is None  # the host's: no reading, no error


def test_a_replay_counts_as_the_tracker_and_splits_phases_as_the_device_marks_them():
    """At micro-batch 5: weights 1024, the activation 15000 -> 15360 rounded, the loss 4 -> 512. The forward phase
    peaks at all three; the backward phase begins with them alive; the allocator model reserves one small segment
    (2 MiB: each block is under 1 MiB); the margin adds 1 MiB to the peak it reports."""
    lines = Lines.through(_trace(3000, 2), 2, _trace(3000, 10), 10)
    r = replay(lines, 5, CachingAllocatorModel(), Margin(fixed_bytes=MiB).total)
    assert r.phase_peaks == {"setup": 1024, "forward": 1024 + 15360 + 512, "backward": 1024 + 15360 + 512}
    assert r.peak_allocated_bytes == 1024 + 15360 + 512
    assert r.modelled_reserved_bytes == 2 * MiB
    assert r.peak_bytes == 1024 + 15360 + 512 + MiB
    assert replay(Lines.through(_trace(3000, 2), 2, _trace(1000, 10), 10), 0, CachingAllocatorModel(),
                  Margin().total) is not None
    shrinking = Lines.through(_trace(3000, 2), 2, _trace(1000, 3), 3)  # sizes that fall with the batch
    assert replay(shrinking, 9, CachingAllocatorModel(), Margin().total) is None  # a negative size: not replayed


def _reading(r) -> tuple:
    return (r.peak_bytes, r.peak_allocated_bytes, r.batch_peak_bytes, r.phase_peaks, r.modelled_reserved_bytes,
            r.host_peak_bytes)


CASES = {  # model file, plan at micro-batch 1, the card the prior accounts by (None: the cpu device's rules)
    "tiny_gpt fp32": (EXAMPLES / "tiny_gpt.py", Plan(1, 64, "fp32"), None),
    "tiny_gpt bf16+ckpt": (EXAMPLES / "tiny_gpt.py", Plan(1, 64, "bf16", activation_checkpointing=True), None),
    "tiny_gpt fp16 on a T4": (EXAMPLES / "tiny_gpt.py", Plan(1, 64, "fp16"), "t4"),
    "mlp_dict fp32": (EXAMPLES / "mlp_dict.py", Plan(1, 16, "fp32"), None),
    "conv_net bf16+ckpt on an A100": (EXAMPLES / "conv_net.py", Plan(1, 16, "bf16", activation_checkpointing=True),
                                      "a100-80"),
    "peft llama fp32 on an A100": (FINETUNE / "hf_llama_lora.py", Plan(1, 32, "fp32"), "a100-80"),
    "peft llama, 8-bit state and optimizer offloaded, on an A100": (  # the host's storages on lines too
        FINETUNE / "hf_llama_lora.py", Plan(1, 32, "bf16-true", activation_checkpointing=True, optimizer_8bit=True,
                                            offload_optimizer=True), "a100-80"),
    "tiny_gpt, activations offloaded, on an A100": (
        EXAMPLES / "tiny_gpt.py", Plan(1, 64, "bf16", activation_checkpointing=True, offload_activations=True),
        "a100-80"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_replay_is_the_fake_trial_it_stands_for_to_the_byte(case):
    """device: fake (the prior's: it never runs out, and traces). Traced at micro-batches 2 and 12, a plan replayed
    at 3, 7 and 40 reads what the fake trial at that size reads: peak, allocated peak, the forward and backward peak
    the search predicts with, every phase's peak, the caching allocator model's reserved peak and the host's peak
    (the offload levers)."""
    path, plan, card = CASES[case]
    if path.parent == FINETUNE and (find_spec("transformers") is None or find_spec("peft") is None):
        pytest.skip("transformers and peft are not installed (pip install -e '.[dev]')")
    mf = load_model_file(path)
    device = prior_device(CpuDevice("2GiB", card=find_gpu(card) if card else None))
    at = lambda b: dataclasses.replace(plan, micro_batch_size=b, global_batch_size=b)  # noqa: E731
    two, twelve = run_trial(mf, at(2), device), run_trial(mf, at(12), device)
    levered = plan.offload_optimizer or plan.offload_activations or plan.nf4_frozen_weights
    assert two.trace.hosted == levered and (two.host_peak_bytes > 0) == levered
    lines = Lines.through(two.trace, 2, twelve.trace, 12)
    assert lines is not None
    for b in (3, 7, 40):
        assert _reading(device.replay(lines, b)) == _reading(run_trial(mf, at(b), device)), b


def test_nf4_weights_quantized_on_the_host_are_replayed_to_the_byte(tmp_path):
    """device: fake (the prior's, an A100's rules). NF4's build quantizes on the host (its peak is the host's): a
    LoRA Llama wide enough for NF4 blocks, traced at 2 and 12, replayed at 5 as its trial reads, host peak too."""
    if find_spec("transformers") is None or find_spec("peft") is None or find_spec("torchao") is None:
        pytest.skip("transformers, peft and torchao are not installed (pip install -e '.[dev]')")
    text = (FINETUNE / "hf_llama_lora.py").read_text()
    path = tmp_path / "wide_lora.py"
    path.write_text(text.replace("hidden_size=64, intermediate_size=128", "hidden_size=256, intermediate_size=512"))
    mf = load_model_file(path)
    device = prior_device(CpuDevice("2GiB", card=find_gpu("a100-80")))
    at = lambda b: Plan(b, 32, "bf16-true", activation_checkpointing=True, optimizer_8bit=True,  # noqa: E731
                        nf4_frozen_weights=True)
    two, twelve = run_trial(mf, at(2), device), run_trial(mf, at(12), device)
    assert two.trace.hosted and two.host_peak_bytes > 0 and two.trace.host_peak() == two.host_peak_bytes
    lines = Lines.through(two.trace, 2, twelve.trace, 12)
    assert lines is not None
    assert _reading(device.replay(lines, 5)) == _reading(run_trial(mf, at(5), device))


RESIZED = """
import torch
from torch import nn

class Resizing(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 4)

    def forward(self, x, y):
        scratch = torch.empty(508 * x.shape[0], dtype=torch.uint8, device=x.device)
        scratch.resize_(508 * x.shape[0] + 4)  # grown in place by less than the 512-byte rounding
        return nn.functional.cross_entropy(self.lin(x).mean(1), y)

def build_model():
    return Resizing()

def make_batch(batch_size, context_length, device):
    return (torch.randn(batch_size, context_length, 64, device=device),
            torch.randint(0, 4, (batch_size,), device=device))
"""


def test_a_resize_within_the_rounding_is_traced_for_the_micro_batches_where_it_crosses_it(write_model):
    """device: fake (the prior's). 508 n bytes grown to 508 n + 4 keeps its 512-byte rounding at n = 2 and 12 (the
    traces) and crosses it at n = 128 (65024 -> 65536): the trace records the resize all the same, and the replay
    at 128 counts the extra block as the fake trial does."""
    mf = load_model_file(write_model(RESIZED))
    device = prior_device(CpuDevice("1GiB"))
    at = lambda b: Plan(b, 4, "fp32")  # noqa: E731
    lines = Lines.through(run_trial(mf, at(2), device).trace, 2, run_trial(mf, at(12), device).trace, 12)
    assert _reading(device.replay(lines, 128)) == _reading(run_trial(mf, at(128), device))


def test_only_a_device_that_never_runs_out_replays():
    device = CpuDevice("64MiB")
    with pytest.raises(ValueError, match="never runs out"):
        device.replay(Lines((), (), (1, 2)), 3)


def test_the_chunked_loss_lines_up_at_micro_batch_1():
    """device: fake (the prior's, an A100's rules). The chunked loss's slices are copied at every micro-batch: at 1
    a slice of the labels (and of fp32 logits) is contiguous and was flattened in place where a larger batch's is
    copied, so micro-batch 1 never lined up with another and a size more was traced (the 7B QLoRA question: one
    trial of four). bf16-true, as the 7B questions' plans (in fp32 this Llama's own forward makes other storages at
    micro-batch 1). Traced at 1 and 6, replayed at 3 as its trial reads."""
    if find_spec("transformers") is None or find_spec("peft") is None:
        pytest.skip("transformers and peft are not installed (pip install -e '.[dev]')")
    mf = load_model_file(FINETUNE / "hf_llama_lora.py")
    device = prior_device(CpuDevice("2GiB", card=find_gpu("a100-80")))
    at = lambda b: Plan(b, 32, "bf16-true", chunked_loss=True)  # noqa: E731
    lines = Lines.through(run_trial(mf, at(1), device).trace, 1, run_trial(mf, at(6), device).trace, 6)
    assert lines is not None
    assert _reading(device.replay(lines, 3)) == _reading(run_trial(mf, at(3), device))
