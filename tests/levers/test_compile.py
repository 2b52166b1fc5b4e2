"""plan.compile (--compile): each block and the loss compiled. devices: cpu (real compute, simulated memory) for the
values, fake for the estimate; on both the calls are traced by AOTAutograd and run as inductor keeps memory
(memory/compiled.py), and the two agree to the byte.

Predicted, from the mechanism: a compiled call keeps for backward what the min-cut partitioner saves (a cheap
pointwise result is recomputed from its input), and a fused kernel's intermediates never exist."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from oomtune.config.schema import Plan
from oomtune.memory.cards import find_gpu
from oomtune.memory.compiled import CompiledCall, buffers, compile_notes, graph_runner
from oomtune.memory.devices import CpuDevice, FakeDevice
from oomtune.model_file import load_model_file
from oomtune.search.options import parse_levers, with_compile
from oomtune.search.trial import run_trial

from ..conftest import run_cli

LORA_LLAMA = Path(__file__).parents[1] / "finetune" / "models" / "hf_llama_lora.py"
N = 64 * 1024  # elements of the test tensors


def _peaks(plan: Plan, device) -> tuple:
    r = run_trial(load_model_file(LORA_LLAMA), plan, device)
    assert not r.oom
    return r.peak_allocated_bytes, r.phase_peaks, r.loss


@pytest.mark.parametrize("levers", [{}, {"precision": "bf16-true", "activation_checkpointing": True},
                                    {"precision": "bf16-true", "chunked_loss": True}],
                         ids=["fp32", "bf16-true+checkpointing", "bf16-true+chunked"])
def test_compiled_step_same_on_cpu_and_fake_same_loss_less_memory(levers):
    plan = Plan(micro_batch_size=4, context_length=64, compile=True, **levers)
    torch.manual_seed(0)
    cpu_peak, cpu_phases, cpu_loss = _peaks(plan, CpuDevice("1GiB"))
    fake_peak, fake_phases, _ = _peaks(plan, FakeDevice("1GiB"))
    torch.manual_seed(0)
    eager_peak, _, eager_loss = _peaks(Plan(micro_batch_size=4, context_length=64, **levers), CpuDevice("1GiB"))
    assert (fake_peak, fake_phases["forward"], fake_phases["backward"]) == \
        (cpu_peak, cpu_phases["forward"], cpu_phases["backward"])
    assert cpu_peak < eager_peak
    assert cpu_loss == pytest.approx(eager_loss, rel=1e-5)
    assert compile_notes() == ()  # every block and the loss traced


def _exp_sum(x: torch.Tensor) -> torch.Tensor:
    return (x.float().exp() * 2).sum()


def test_saved_tensors_are_the_partitioners_and_fused_intermediates_never_exist():
    """bf16 x -> fp32 copy -> exp -> x2 -> sum. Eager: the forward makes the fp32 copy and exp's output (4 bytes an
    element each, both alive at once) and keeps exp's output for backward. Compiled: one fused kernel that writes
    the sum alone, and backward recomputes exp from x (with inductor's decompositions the partitioner saves nothing
    else; without them it kept exp's output)."""
    def run(call) -> tuple[int, int, torch.Tensor]:
        device = CpuDevice("1GiB")
        with device.measure():
            torch.manual_seed(0)
            x = torch.randn(N, dtype=torch.bfloat16, requires_grad=True)
            before = device.live_bytes()
            device.tracker.reset_peak()
            loss = call(x)
            forward_peak, kept = device.tracker.peak_bytes - before, device.live_bytes() - before
            loss.backward()
            return forward_peak, kept, x.grad

    eager_peak, eager_kept, eager_grad = run(_exp_sum)
    peak, kept, grad = run(CompiledCall("exp_sum", _exp_sum))
    assert eager_kept >= 4 * N and eager_peak >= 2 * 4 * N  # exp's output kept; the fp32 copy beside it
    assert peak == kept and kept < 1024  # the loss's scalar storage alone
    assert torch.equal(grad, eager_grad)


def test_buffers_are_what_unfused_ops_read_and_the_outputs():
    def f(x, w):
        h = (x * 2).relu()  # pointwise into a matmul: written out (the matmul reads it)
        y = h @ w
        return (y.sin() + 1).sum(-1)  # pointwise and a reduction after it: only the output written

    graph = make_fx(f)(torch.randn(4, 8), torch.randn(8, 8)).graph
    kept = {n.target.overloadpacket.__name__ for n in buffers(graph) if n.op == "call_function"}
    assert kept == {"relu", "mm", "sum"}


BRANCHY = '''
import torch
from torch import nn


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x)
        return h.relu() if h.sum() > 0 else h.tanh()  # a branch on values: no graph


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Branchy(), Branchy()])

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return nn.functional.mse_loss(x, y)


def build_model():
    return Net()


def blocks(model):
    return list(model.blocks)


def make_batch(batch_size, context_length, device):
    return (torch.randn(batch_size, context_length, 16, device=device),
            torch.randn(batch_size, context_length, 16, device=device))
'''


def test_a_call_that_cannot_be_traced_runs_eager_and_says_so(write_model):
    compile_notes()
    block = load_model_file(write_model(BRANCHY)).module.Branchy()
    call = CompiledCall("block 0 (Branchy)", block.forward, block)
    x = torch.randn(8, 16)
    assert torch.equal(call(x), block(x))
    assert call.eager_why is not None
    notes = compile_notes()
    assert len(notes) == 1 and "block 0 (Branchy)" in notes[0] and "eager" in notes[0]


def test_compile_in_levers_and_the_flag():
    assert "compile" in parse_levers("amp,compile")
    assert "compile" not in parse_levers(None)  # not climbed: named or asked for
    assert parse_levers(with_compile(None, True)) == parse_levers(None) | {"compile"}
    assert with_compile(None, True, one_plan=True) == "compile"
    assert with_compile("none", True) == "compile"


def test_estimate_what_if_with_compile(tmp_path):
    args = ["estimate", str(LORA_LLAMA), "--budget", "1GiB", "--margin", "0", "--micro-batch", "4", "--context",
            "64", "--json"]
    eager = json.loads(run_cli(*args).stdout)
    result = run_cli(*args, "--compile")
    report = json.loads(result.stdout)
    assert report["plan"]["compile"] is True and eager["plan"]["compile"] is False
    assert report["breakdown"]["tensor_peak_bytes"] < eager["breakdown"]["tensor_peak_bytes"]


def test_exports_say_compile():
    from oomtune.config.export import export

    plan = Plan(1, 4, compile=True)
    assert export(plan, "torchtune").values["compile"] is True
    assert export(plan, "hf").values["torch_compile"] is True
    for target in ("lightning", "accelerate"):
        assert any(line.startswith("compile: ") for line in export(plan, target).unexpressed)
    assert "compile" not in export(Plan(1, 4), "torchtune").values


def test_probe_with_compile_writes_it_and_training_from_it_has_the_eager_losses(tmp_path, monkeypatch):
    """device: cpu. probe --compile: every rung's plan compiled, written in the config; train from it gives the
    losses of the same config without the key."""
    import yaml

    from ..conftest import trained_with_and_without

    monkeypatch.chdir(tmp_path)
    r = run_cli("probe", LORA_LLAMA, "--device", "cpu", "--budget", "1GiB", "--batch", "4", "--context", "32",
                "--compile", "--out", "c.yaml", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["plan"]["compile"] is True
    assert "every rung compiled (torch.compile)" in r.stderr.splitlines()[0]  # (the rungs' names do not say it)
    config = yaml.safe_load((tmp_path / "c.yaml").read_text())
    compiled_run, eager_run = trained_with_and_without(tmp_path, config, "compile", 3)
    assert [s for s, _ in compiled_run] == [s for s, _ in eager_run] == [1, 2, 3]
    assert [x for _, x in compiled_run] == pytest.approx([x for _, x in eager_run], rel=1e-5)


NO_BLOCKS = '''
import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, 16, device=device), torch.randn(batch_size, 16, device=device)


def loss(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)
'''


def test_a_model_without_blocks_trains_eager_and_is_told(write_model):
    """device: fake. Nothing to compile (no blocks, its own loss): the trial runs, its peak is the eager plan's, and
    the note says so."""
    compile_notes()
    model_file = load_model_file(write_model(NO_BLOCKS))
    compiled_run = run_trial(model_file, Plan(4, 1, compile=True), FakeDevice("1GiB"))
    eager_run = run_trial(model_file, Plan(4, 1), FakeDevice("1GiB"))
    assert compiled_run.peak_allocated_bytes == eager_run.peak_allocated_bytes
    notes = compile_notes()
    assert len(notes) == 1 and notes[0].startswith("compiled blocks: ") and "define blocks(model)" in notes[0]


def test_an_input_dies_at_its_last_use_in_the_graph():
    """device: cpu. a -> b = a@a -> c = b@b -> c@c, `a` held by the graph alone (as backward is handed its saved
    tensors): each mm's output is the only new tensor beside what is still read, so the peak is the input's size
    plus one (with the input held to the end, it was two more)."""
    size = 256 * 256 * 4
    run = graph_runner(make_fx(lambda a: ((a @ a) @ (a @ a)) @ a)(torch.randn(256, 256)))
    chain = graph_runner(make_fx(lambda a: (((a @ a) @ (a @ a)).sum(), )[0])(torch.randn(256, 256)))
    device = CpuDevice("1GiB")
    with device.measure():
        args = [torch.randn(256, 256)]
        before = device.live_bytes()
        device.tracker.reset_peak()
        run(args)  # a@a twice and the product with a: a must live to the last mm
        held = device.tracker.peak_bytes - before
        args = [torch.randn(256, 256)]
        before = device.live_bytes()
        device.tracker.reset_peak()
        chain(args)  # a's last use is the second a@a: freed before the product is made
        freed = device.tracker.peak_bytes - before
    assert held == 3 * size and freed == 2 * size


def test_dropout_draws_its_numbers_inside_the_kernel():
    """device: cpu. dropout then a sum: the random numbers (fp32, 4 bytes an element) never exist; forward writes
    the bool mask it keeps for backward (1 byte an element) and the sum."""
    def run(call) -> int:
        device = CpuDevice("1GiB")
        with device.measure():
            x = torch.randn(N, requires_grad=True)
            before = device.live_bytes()
            device.tracker.reset_peak()
            call(x)
            return device.tracker.peak_bytes - before

    def drop(x):
        return torch.nn.functional.dropout(x, 0.1, True).sum()

    assert run(drop) >= 4 * N  # eager: the numbers drawn, in fp32
    assert run(CompiledCall("drop", drop)) < 2 * N


def test_attention_dropout_keeps_no_attention_weights_on_a_card():
    """device: fake, an H100's rules. SDPA with dropout in a compiled call is traced as the fused kernel CUDA runs
    (output and log-sum-exp kept), not the CPU's math kernel with its batch x heads x T x T weights (32 MiB here)."""
    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)

    device = FakeDevice(gpu=find_gpu("h100"))
    with device.measure():
        q, k, v = (torch.randn(2, 8, 1024, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        before = device.live_bytes()
        out = CompiledCall("attention", attend)(q, k, v)
        kept = device.live_bytes() - before
        del out
    assert kept < 4 * 2 * 8 * 1024 * 64 * 2  # the output (2 MiB) and the log-sum-exp; never the 32 MiB weights


def test_training_mode_is_part_of_what_is_traced():
    block = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5))
    call = CompiledCall("block", block.forward, block)
    x = torch.randn(16, 64)
    call(x)  # traced in training mode
    block.eval()
    assert torch.equal(call(x), block(x))  # eval: no dropout (a trace of training mode would drop half)


GPT2 = '''
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def build_model():
    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=2))


def make_batch(batch_size, context_length, device):
    ids = torch.randint(0, 128, (batch_size, context_length), device=device)
    return {"input_ids": ids, "labels": ids}
'''


def test_gpt2_whose_blocks_are_handed_a_cache_positionally(write_model):
    """device: fake. GPT-2's blocks take the (empty, training) KV cache as a positional argument: traced without
    it, the step compiled, nothing run eager; a PEFT prefix in the cache (keys already held) runs eager, named."""
    compile_notes()
    model_file = load_model_file(write_model(GPT2, "gpt2_tiny.py"))
    compiled_run = run_trial(model_file, Plan(4, 32, compile=True), FakeDevice("1GiB"))
    eager_run = run_trial(model_file, Plan(4, 32), FakeDevice("1GiB"))
    assert not compiled_run.oom and compile_notes() == ()
    assert compiled_run.peak_allocated_bytes < eager_run.peak_allocated_bytes
    prefix = load_model_file(Path(__file__).parents[1] / "finetune" / "models" / "hf_gpt2_prefix.py")
    assert not run_trial(prefix, Plan(2, 16, compile=True), FakeDevice("1GiB")).oom
    notes = compile_notes()
    assert notes and all("KV cache that holds keys already" in n for n in notes)


def test_training_says_which_compiled_calls_run_eager(write_model, tmp_path):
    """device: cpu. A config with compile: true whose blocks cannot be traced: train runs them eager and says so
    once, at the step that first ran them, as estimate and probe say it."""
    from oomtune.memory.compiled import fallbacks

    path = write_model(BRANCHY)
    r = run_cli("estimate", path, "--budget", "1GiB", "--batch", "4", "--context", "8", "--compile",
                "--out", tmp_path / "c.yaml")
    assert r.exit_code == 0 and "compiled block 0" in r.output, r.output
    fallbacks["an earlier search's call"] = "stale"  # (left in the process: not this run's, never told)
    train = run_cli("train", "--config", tmp_path / "c.yaml", "--steps", "3", "--device", "cpu",
                    "--run-dir", tmp_path / "run")
    assert train.exit_code == 0, train.output
    said = [line for line in train.output.splitlines() if "it trains eager" in line]
    assert len(said) == 2 and all("(step 1)" in line for line in said), train.output
    assert "stale" not in train.output
