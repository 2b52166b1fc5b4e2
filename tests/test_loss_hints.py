"""The default loss's first mistakes, named with the `loss(model, batch)` hook to write (oomtune/hook_names.py): a
forward that takes no labels, logits returned for a loss. Tried at micro-batch 1 on fake tensors before any trial."""

import re

import pytest
import torch

from oomtune.errors import ModelFileError
from oomtune.model_file import load_model_file

from .conftest import TINY_MODEL
from .test_model_file import probe_error

CLASSIFIER = """
import torch
from torch import nn

def build_model():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, 8, 8, device=device), torch.randint(0, 10, (batch_size,), device=device)
"""


def test_a_classifier_whose_forward_takes_no_labels_is_told_of_the_loss_hook_before_any_trial(write_model):
    """device: cpu (and the fake device's first loss). model(*batch) gave forward(x) the labels too: a bare "the
    model's forward raised TypeError: forward() takes 2 positional arguments but 3 were given", after a first trial
    (25 s on a real model). Now the default loss is tried at micro-batch 1 on fake tensors before the ladder, and the
    line names the loss hook with one to copy."""
    import oomtune

    trials = []
    with pytest.raises(ModelFileError) as raised:
        oomtune.probe(write_model(CLASSIFIER), batch=4, context=1, device="cpu", budget="64MiB",
                      on_start=trials.append)
    assert str(raised.value) == (
        "model.py: the default loss calls model(*batch) with the batch's 2 items, and Sequential.forward(input) "
        "refuses them (too many positional arguments): define loss(model, batch) to run the model and return the "
        "loss, e.g. `def loss(model, batch): x, y = batch; return F.cross_entropy(model(x), y)`")
    assert trials == []  # before the first trial
    assert probe_error(write_model(CLASSIFIER)).startswith("error: model.py: the default loss calls model(*batch)")
    fixed = write_model(CLASSIFIER + "\nimport torch.nn.functional as F\n"
                        "def loss(model, batch): x, y = batch; return F.cross_entropy(model(x), y)\n", name="fixed.py")
    assert oomtune.probe(fixed, batch=4, context=1, device="cpu", budget="64MiB").plan.micro_batch_size == 4


def test_a_model_returning_logits_is_told_it_needs_a_loss_not_a_mean(write_model):
    """device: cpu. The line said to reduce the logits (.mean()), which trains a model to make its outputs small."""
    logits = TINY_MODEL.replace("return nn.functional.cross_entropy(self.out(x).mean(1), y)",
                                "return self.out(x).mean(1)")
    assert probe_error(write_model(logits)) == (
        "error: model.py: the model returned what looks like logits, of shape (1, 4), not a loss: training needs a "
        "loss, a scalar; define loss(model, batch) to compute it, e.g. `def loss(model, batch): x, y = batch; "
        "return F.cross_entropy(model(x, y), y)`")
    lm = TINY_MODEL.replace("return nn.functional.cross_entropy(self.out(x).mean(1), y)", "return self.out(x)")
    mf = load_model_file(write_model(lm, name="lm.py"))
    with pytest.raises(ModelFileError, match=re.escape("lm.py: the model returned what looks like logits, of shape "
                                                       "(2, 3, 4), not a loss") + ".*" + re.escape(
            "F.cross_entropy(model(x, y).flatten(0, 1), y.flatten())`")):
        mf.loss(mf.build(), mf.batch(2, 3, torch.device("cpu")))


STACKED = """
import torch
from torch import nn

CALLS = []


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        CALLS.append(len(CALLS))
        return torch.relu(self.lin(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 16)
        self.layers = nn.ModuleList([Block() for _ in range(6)])
        self.out = nn.Linear(16, 10)

    def forward(self, x, y):
        h = self.emb(x)
        for LOOP:
            h = layer(h)
        return RETURN


def build_model():
    return Net()


def make_batch(batch_size, context_length, device):
    x = torch.randint(0, 10, (batch_size, context_length), device=device)
    return x, x
"""
LOSS = "nn.functional.cross_entropy(self.out(h).flatten(0, 1), y.flatten())"


@pytest.mark.parametrize(("loop", "ret", "forwarded"), [
    ("for layer in self.layers:", LOSS, 2),  # 2 of the 6 blocks: the check passes there
    ("for layer in self.layers:", "self.out(h)", 2 + 6),  # logits, not a loss: told, from the whole model's forward
    ("for i in range(6):\n            layer = self.layers[i]", LOSS, 2 + 6),  # fails with 2 of them: runs whole
])
def test_the_first_loss_is_checked_on_two_of_the_repeated_blocks(write_model, monkeypatch, loop, ret, forwarded):
    """device: fake (static_memory's first loss). A 7B Llama's first-loss forward took 2.8 s of 32 layers; on 2 of
    them, what it checks (the batch the forward takes, the loss it returns) is the same. Where the forward fails with
    fewer blocks, the whole model's runs and says what is wrong; the stack holds its blocks again after."""
    from oomtune.memory import breakdown

    mf = load_model_file(write_model(STACKED.replace("for LOOP:", loop).replace("RETURN", ret)))
    calls, seen = mf.module.CALLS, []
    real = breakdown.check_first_loss

    def check(model_file, model, *args):
        before = len(calls)
        try:
            real(model_file, model, *args)
        finally:
            seen.append((len(calls) - before, len(model.layers)))

    monkeypatch.setattr(breakdown, "check_first_loss", check)
    if ret == LOSS:
        breakdown.static_memory(mf)
    else:
        with pytest.raises(ModelFileError, match="looks like logits"):
            breakdown.static_memory(mf)
    assert seen == [(forwarded, 6)]
