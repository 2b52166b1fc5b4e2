"""A trial measures the step the trainer runs (device: `cpu`, simulated memory, real compute)."""

from __future__ import annotations

import pytest
import torch

from oomtune.config.schema import Plan
from oomtune.memory.devices import make_device
from oomtune.model_file import load_model_file
from oomtune.search import trial

from ..conftest import EXAMPLES

FINETUNE_MODELS = EXAMPLES.parent / "tests" / "finetune" / "models"

# The loss is large, so fp16 gradients overflow at the GradScaler's first scales (65536, 32768, ...): the scaler
# skips those optimizer steps, and AdamW's state only exists once one is taken.
LOUD_MODEL = '''
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))
        self.out = nn.Linear(32, 4)

    def forward(self, x, y):
        for b in self.blocks:
            x = torch.relu(b(x))
        return nn.functional.cross_entropy(self.out(x).mean(1), y) * 1000.0

def build_model():
    return Net()

def make_batch(batch_size, context_length, device):
    return (torch.randn(batch_size, context_length, 32, device=device),
            torch.randint(0, 4, (batch_size,), device=device))
'''


def optimizer_state_after_trial(model_file, plan: Plan) -> tuple[int, float]:
    seen = {}

    def observe(t, phase):
        if phase == "end":
            seen["state"], seen["scale"] = len(t.optimizer.state), t.scaler.get_scale()

    result = trial.run_trial(model_file, plan, make_device("cpu", "1GiB"), steps=2, observe=observe)
    assert not result.oom
    return seen["state"], seen["scale"]


def test_an_fp16_trial_goes_on_until_the_grad_scaler_takes_an_optimizer_step(write_model, monkeypatch):
    """A model file's own AdamW (foreach, as CUDA runs it) makes no state in a step the scaler skips; oomtune's
    default, fused, makes it in the first step, skipped or not (the kernel is told of the overflow)."""
    own = load_model_file(write_model(LOUD_MODEL + "\ndef optimizer(params, lr):\n"
                                                   "    return torch.optim.AdamW(params, lr=lr)\n"))
    plan = Plan(4, 16, precision="fp16")
    params = len(list(own.build().parameters()))

    monkeypatch.setattr(trial, "MAX_SKIPPED_STEPS", 0)  # the trial as it was: its 2 steps, whatever happened
    state, scale = optimizer_state_after_trial(own, plan)
    assert (state, scale) == (0, 65536.0 / 4)  # both skipped: no AdamW state, so the peak would miss it
    state, scale = optimizer_state_after_trial(load_model_file(write_model(LOUD_MODEL)), plan)
    assert (state, scale) == (params, 65536.0 / 4)  # fused: skipped too, its state made all the same

    monkeypatch.undo()
    state, scale = optimizer_state_after_trial(own, plan)
    assert state == params and scale < 65536.0 / 4  # kept going until a step was taken


@pytest.mark.parametrize("accum", [3, 8])
def test_a_trial_holds_a_whole_steps_micro_batches_as_the_trainer_does(write_model, accum):
    """The trainer draws all grad_accum_steps micro-batches of a step before running it (to retry them after an
    OOM): the trial's peak holds them too, though it computes at most 2 - so past 2, each more micro-batch
    costs exactly its inputs' bytes."""
    model_file = load_model_file(write_model(LOUD_MODEL))
    device = make_device("cpu", "1GiB")
    two = trial.run_trial(model_file, Plan(4, 16, grad_accum_steps=2), device).peak_bytes
    more = trial.run_trial(model_file, Plan(4, 16, grad_accum_steps=accum), device).peak_bytes
    batch_bytes = 4 * 16 * 32 * 4 + 512  # x (fp32, a multiple of 512) and y (4 int64s, one 512-byte block)
    assert more - two == (accum - 2) * batch_bytes


WIDE_MODEL = '''
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(256, 256, bias=False) for _ in range(8))

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return (x - y).pow(2).mean()

def build_model():
    return Net()

def make_batch(batch_size, context_length, device):
    return (torch.randn(batch_size, context_length, 256, device=device),
            torch.randn(batch_size, context_length, 256, device=device))
'''


def test_the_default_adamw_is_fused_and_a_model_files_own_runs_as_cuda_does(write_model, monkeypatch):
    """device: cpu. Eight 256x256 weights (2 MiB) and one example: the peak is the optimizer step. oomtune's default
    AdamW is fused (one kernel, no scratch): weights + gradients + 2 moments = 4 x 2 MiB and a little. A model file's
    own AdamW that leaves the choice to torch runs as CUDA runs it, foreach, which holds sqrt(second moment) for
    every weight at once: 5 x 2 MiB; the per-tensor loop torch picks on the CPU holds it for one or two at a time."""
    from oomtune import step

    weights = 8 * 256 * 256 * 4

    def peak(model_file) -> int:
        r = trial.run_trial(model_file, Plan(1, 1), make_device("cpu", "1GiB"), steps=2)
        assert not r.oom
        return r.peak_bytes

    default = load_model_file(write_model(WIDE_MODEL))
    assert all(g["fused"] for g in default.optimizer(list(default.build().parameters()), 0.1).param_groups)
    assert 4 * weights <= peak(default) < 4 * weights + weights // 8
    own = load_model_file(write_model(WIDE_MODEL + "\ndef optimizer(params, lr):\n"
                                                   "    return torch.optim.AdamW(params, lr=lr)\n"))
    assert peak(own) >= 5 * weights
    monkeypatch.setattr(step, "as_on_cuda", lambda optimizer, device: None)  # torch's own choice on the CPU
    assert 4 * weights < peak(own) < 5 * weights


def test_a_reused_model_measures_what_a_fresh_one_does_and_starts_from_its_built_weights():
    """device: cpu. A probe's trials on one rung share one model (trial.ModelCache): built once, its weights put
    back before each trial and its gradients dropped. The peaks equal those of trials that each build their own."""
    mf = load_model_file(EXAMPLES / "tiny_gpt.py")
    plans = [Plan(b, 64, "bf16", activation_checkpointing=True) for b in (4, 2, 8)] + [Plan(4, 64, "fp32")]
    builds = []
    build = mf.build

    def counted():  # the same initial weights for every build, and the same batches after it
        builds.append(1)
        torch.manual_seed(0)
        model = build()
        torch.manual_seed(1)
        return model

    mf.build = counted
    try:
        def seeded(*args, **kwargs):  # the same batches where the trial reuses the model (and builds none)
            torch.manual_seed(1)
            return trial.run_trial(*args, **kwargs)

        fresh = [seeded(mf, p, make_device("cpu", "1GiB")) for p in plans]
        n_fresh = len(builds)
        cache, device = trial.ModelCache(), make_device("cpu", "1GiB")
        first = cache  # the same object throughout
        reused = [seeded(mf, p, device, models=first) for p in plans]
    finally:
        mf.build = build
    assert n_fresh == 4 and len(builds) - n_fresh == 2  # the bf16+ckpt rung built once, then fp32
    assert [r.peak_bytes for r in reused] == [r.peak_bytes for r in fresh]
    # each trial starts from the weights as built (the steps before moved them): the same first loss
    assert [r.loss for r in reused] == [r.loss for r in fresh]
    trained = [p for p in first.model.parameters() if p.requires_grad]
    assert any(not torch.equal(p, v) for p, (_, v) in zip(trained, first.saved, strict=False))
    assert all(p.grad is None for p in first.take(plans[-1], device).parameters())
    # a plan that cannot reuse it (NF4 weights) drops it
    assert first.take(plans[-1], device, reusable=False) is None and first.model is None


def test_a_search_leaves_what_the_first_step_imports_out_of_every_collection():
    """device: cpu. In a fresh process (this session's are settled already): the first optimizer step imports
    torch._dynamo, sympy and the rest (~120k objects); settled_objects imports them before it freezes, so after a
    trial the garbage collector still tracks only what the trial left, a few thousand objects, not all of those."""
    import subprocess
    import sys

    code = f'''
import gc
from oomtune.config.schema import Plan
from oomtune.memory.devices import CpuDevice
from oomtune.model_file import load_model_file
from oomtune.search.trial import run_trial, settled_objects

mf = load_model_file({str(EXAMPLES / "tiny_gpt.py")!r})
with settled_objects():
    run_trial(mf, Plan(2, 32, global_batch_size=2), CpuDevice("64MiB"))
    gc.collect()
    print(len(gc.get_objects()))
'''
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) < 20_000, out.stdout


def test_what_the_cli_froze_at_its_start_is_left_out_until_the_search_ends():
    """In a fresh process: imports_settled (the CLI's estimate, once the model file is loaded) freezes what the
    process holds (torch and the model file: over 100k objects) with no collection, so the search's collection
    before its own freeze walks only what was made since - and the search's end unfreezes them all."""
    import subprocess
    import sys

    code = f'''
import gc
from oomtune.model_file import load_model_file
from oomtune.search.trial import imports_settled, settled_objects

mf = load_model_file({str(EXAMPLES / "tiny_gpt.py")!r})
imports_settled()
frozen = gc.get_freeze_count()
with settled_objects():
    inside = gc.get_freeze_count()
print(frozen, inside, gc.get_freeze_count())
'''
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    frozen, inside, after = (int(x) for x in out.stdout.split()[-3:])
    assert frozen > 100_000 and inside >= frozen and after == 0, out.stdout


def test_the_first_trial_of_a_peft_model_counts_none_of_what_its_libraries_import():
    """device: fake (a card's rules, both steps traced). In a fresh process (this session's may have imported them
    already): PEFT imports bitsandbytes as it wraps the layers, and bitsandbytes' import makes tensors of its own
    (a 256-entry map). A module imported inside a trial runs outside it (memory/imports.py): the first trial of a
    LoRA Llama leaves nothing behind and reads what the same plan traced after it reads (it read 1 KiB more, on a
    CPU with AVX512-BF16)."""
    import subprocess
    import sys

    pytest.importorskip("bitsandbytes")
    code = f'''
from oomtune.config.schema import Plan
from oomtune.memory.cards import find_gpu
from oomtune.memory.devices import FakeDevice
from oomtune.model_file import load_model_file
from oomtune.search.trial import run_trial

mf = load_model_file({str(FINETUNE_MODELS / "hf_llama_lora.py")!r})
plan = Plan(2, 32, "bf16", activation_checkpointing=True, global_batch_size=2)
twin = lambda: FakeDevice("80GiB", gpu=find_gpu("a100-80"), never_runs_out=True, traces=True)
for _ in range(2):
    r = run_trial(mf, plan, twin())
    print("figures:", r.left_bytes, r.peak_allocated_bytes)
'''
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    first, second = (line.split()[1:] for line in out.stdout.splitlines() if line.startswith("figures:"))
    assert first == second and first[0] == "0", out.stdout
