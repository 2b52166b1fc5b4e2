"""Activation checkpointing's wrapper (oomtune/checkpointing.py): a recomputed block leaves the buffers its forward
writes as one forward left them; which blocks are alike (repeated_runs). device: none (real tensors)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from oomtune.memory.breakdown import static_memory
from oomtune.model_file import load_model_file
from tests.conftest import run_cli

BATCH_NORMED = """
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return x + torch.relu(self.bn(self.conv(x)))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.square().mean()

def build_model():
    torch.manual_seed(0)
    return Net()

def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, 4, context_length, context_length, device=device)

def loss(model, batch):
    return model(batch)
"""


def test_checkpointed_batch_norms_update_their_running_statistics_once_a_step(write_model):
    """device: none (real tensors). Backward's recompute of a checkpointed block ran its batch norms' training
    forward again: running mean and variance moved twice a step, and the batch count said 2."""
    mf = load_model_file(write_model(BATCH_NORMED))
    plain, wrapped = mf.build(), mf.build()
    mf.enable_checkpointing(wrapped)
    torch.manual_seed(1)
    x = torch.randn(3, 4, 5, 5)
    for model in (plain, wrapped):
        mf.loss(model, x).backward()
    for a, b in zip(plain.modules(), wrapped.modules(), strict=True):
        if isinstance(a, nn.BatchNorm2d):
            assert int(b.num_batches_tracked) == 1
            assert torch.equal(a.running_mean, b.running_mean) and torch.equal(a.running_var, b.running_var)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), wrapped.parameters(), strict=True))



def test_checkpointed_blocks_update_any_buffer_their_forward_writes_once_a_step(write_model):
    """device: none (real tensors). Not only batch norms: a block counting its calls and keeping an EMA of its input
    in buffers (in place) had both moved twice a step by backward's recompute (seen == 2 after one step). A buffer
    its forward does not write is left alone."""
    source = BATCH_NORMED.replace("        self.bn = nn.BatchNorm2d(4)\n", """        self.bn = nn.BatchNorm2d(4)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(4))
        self.register_buffer("table", torch.arange(4.0))
""").replace("        return x + torch.relu(self.bn(self.conv(x)))\n", """        if self.training:
            with torch.no_grad():
                self.seen += 1
                self.ema.mul_(0.9).add_(0.1 * x.mean((0, 2, 3)))
        return x + torch.relu(self.bn(self.conv(x))) * self.table[None, :, None, None]
""")
    mf = load_model_file(write_model(source))
    plain, wrapped = mf.build(), mf.build()
    mf.enable_checkpointing(wrapped)
    x = torch.randn(3, 4, 5, 5)
    for model in (plain, wrapped):
        for _ in range(2):
            mf.loss(model, x).backward()
    for (name, a), b in zip(plain.named_buffers(), wrapped.buffers(), strict=True):
        assert torch.equal(a, b), name
    assert [int(b.seen) for b in wrapped.blocks] == [2, 2]
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), wrapped.parameters(), strict=True))


CONSTANT_BUFFER = (BATCH_NORMED  # the same blocks, each a linear layer and a constant mask it never writes
                   .replace("""        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
""", """        self.lin = nn.Linear(8, 8)
        self.register_buffer("mask", torch.tril(torch.ones(8, 8)))
""").replace("return x + torch.relu(self.bn(self.conv(x)))", "return x + torch.tanh(self.lin(x) @ self.mask)")
                   .replace("torch.randn(batch_size, 4, context_length, context_length, device=device)",
                            "torch.randn(batch_size, context_length, 8, device=device)"))


def test_a_block_with_buffers_recomputes_for_every_backward_and_compiles(write_model):
    """Every block with a buffer gets the context that keeps them: it is re-entered for each backward through the
    block (retain_graph, a gradient penalty's autograd.grad then backward: 'no attribute args' when it was a
    one-shot generator), and compiled, where torch takes no context_fn (an AssertionError from the compiler)."""
    mf = load_model_file(write_model(CONSTANT_BUFFER))
    plain, wrapped = mf.build(), mf.build()
    mf.enable_checkpointing(wrapped)
    x = torch.randn(2, 4, 8)
    for model in (plain, wrapped):
        out = mf.loss(model, x)
        out.backward(retain_graph=True)
        out.backward()
        (g,) = torch.autograd.grad(mf.loss(model, x), model.blocks[0].lin.weight, create_graph=True)
        g.square().sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), wrapped.parameters(), strict=True))
    compiled = torch.compile(wrapped, backend="aot_eager")
    mf.loss(compiled, x).backward()


SELF_CHECKPOINTING = (CONSTANT_BUFFER  # its forward checkpoints each block itself, behind a switch Swin's code names
                      .replace("        self.blocks = nn.ModuleList(Block() for _ in range(2))\n",
                               "        self.blocks = nn.ModuleList(Block() for _ in range(2))\n"
                               "        self.use_checkpoint = True\n")
                      .replace("            x = b(x)\n",
                               "            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False) "
                               "if self.use_checkpoint else b(x)\n")
                      .replace("import torch\n", "import torch\nimport torch.utils.checkpoint\n", 1))
WRAPPED = CONSTANT_BUFFER.replace("    return Net()\n", """    net = Net()
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    net.blocks = nn.ModuleList(checkpoint_wrapper(b) for b in net.blocks)
    return net
""")


@pytest.mark.parametrize("source, how", [(SELF_CHECKPOINTING, "Net.use_checkpoint is True"),
                                         (WRAPPED, "its blocks are wrapped in torch's CheckpointWrapper")])
def test_a_model_built_checkpointing_itself_gets_no_checkpointing_rung(write_model, tmp_path, source, how):
    """device: fake (estimate). A model whose build_model() switched its own checkpointing on (a module attribute
    libraries use for it, set True; torchtune's and torchtitan's CheckpointWrapper) runs every rung checkpointed:
    a checkpointing rung measured the same peaks again. It has none, and the note says how it was seen; the same
    model with its switch off keeps the rung."""
    path = write_model(source)
    r = run_cli("estimate", path, "--budget", "400KiB", "--margin", "0", "--batch", "64", "--context", "64",
                "--out", tmp_path / "e.yaml", "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert [(rung["rung"], rung["micro_batch_size"]) for rung in report["rungs"]] == [("fp32", 24), ("amp", 24)]
    assert (f"no activation checkpointing rung: model.py's build_model() turns the model's own activation "
            f"checkpointing on ({how}), so every rung runs checkpointed already") in report["notes"]
    off = source.replace("self.use_checkpoint = True", "self.use_checkpoint = False")
    off = off.replace("    net.blocks = nn.ModuleList(checkpoint_wrapper(b) for b in net.blocks)\n", "")
    static = static_memory(load_model_file(write_model(off, "off.py")))
    assert static.checkpointing_supported and static.checkpoints_itself is None


OWN_CALL = (CONSTANT_BUFFER  # its forward checkpoints each block, behind a switch of its own name no library uses
            .replace("        self.blocks = nn.ModuleList(Block() for _ in range(2))\n",
                     "        self.blocks = nn.ModuleList(Block() for _ in range(2))\n"
                     "        self.recompute = True\n")
            .replace("            x = b(x)\n",
                     "            x = checkpoint(b, x, use_reentrant=False) if self.recompute else b(x)\n")
            .replace("import torch\n", "import torch\nfrom torch.utils.checkpoint import checkpoint\n", 1))


def test_a_forward_that_calls_checkpoint_itself_gets_no_checkpointing_rung(write_model):
    """device: fake (static memory). No attribute says it: one forward on fake tensors counts the calls (through the
    name the model file imported checkpoint by), so the ladder has no rung that would measure the same peaks
    again; with its switch off it calls none, and the rung stays."""
    on = static_memory(load_model_file(write_model(OWN_CALL)))
    assert not on.checkpointing_supported
    assert on.checkpoints_itself == "Net.forward calls torch.utils.checkpoint in every forward"
    off = static_memory(load_model_file(write_model(OWN_CALL.replace("self.recompute = True",
                                                                     "self.recompute = False"), "off.py")))
    assert off.checkpointing_supported and off.checkpoints_itself is None
    import torch.utils.checkpoint as tuc

    assert tuc.checkpoint.__name__ == "checkpoint"  # put back


class _Layer(nn.Module):
    def __init__(self, index: int, window=None, rate: float = 0.0):
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.attn.layer_idx = index  # (a layer's index, on a submodule as Hugging Face keeps it)
        self.window, self.rate = window, rate


def _runs(*layers: _Layer) -> list[tuple[int, int]]:
    from oomtune.checkpointing import repeated_runs

    model = nn.Module()
    model.layers = nn.ModuleList(layers)
    return [(len(stack), start) for stack, start in repeated_runs(model)]


def test_blocks_are_alike_by_every_setting_but_their_index():
    """The run of alike blocks (what the estimate makes trials from fewer of): a layer's index leaves them alike,
    from any offset, also where the first layer keeps its own elsewhere; a window (None against an int, or a pair),
    a rate, or an int that grows but not with every layer tells them apart."""
    assert _runs(*(_Layer(i) for i in range(8))) == [(8, 0)]
    assert _runs(*(_Layer(i, None if i < 3 else 64) for i in range(8))) == [(8, 3)]
    assert _runs(*(_Layer(i, rate=0.1 * i) for i in range(8))) == []
    assert _runs(*(_Layer(i, None if i < 3 else i) for i in range(8))) == []  # a window that grows: not an index
    assert _runs(*(_Layer(i, rate=0.1) for i in range(4)), *(_Layer(i, rate=0.2) for i in range(4, 8))) == [(8, 4)]
    assert _runs(*(_Layer(i + 10) for i in range(8))) == [(8, 0)]  # an index from another offset
    assert _runs(*(_Layer(i, (-1, -1) if i < 4 else (64, 64)) for i in range(8))) == [(8, 4)]  # a pair (ModernBERT)
    first = _Layer(0)
    del first.attn.layer_idx  # (its index elsewhere: a hybrid's first layer)
    first.mixer_idx = 0
    assert _runs(first, *(_Layer(i) for i in range(1, 8))) == [(8, 1)]
