"""device: none (plain cpu tensors, no tracker). The card's kernels registered for a `with` leave no trace in torch's
Python dispatcher: a call traced by AOTAutograd after them (the compiled loss of a cpu-device probe run in the
process after an estimate with a card's rules) keeps its autograd."""

import torch
import torch.nn.functional as F

from oomtune.memory.cards import GENERIC
from oomtune.memory.compiled import CompiledCall
from oomtune.memory.cuda_autocast import cuda_autocast
from oomtune.memory.cuda_kernels import cuda_kernels


def _loss(logits, labels):
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def _traced_loss(logits, labels):
    logits = logits.detach().requires_grad_()
    loss = CompiledCall("the loss", _loss)(logits, labels)
    return loss, logits


def test_a_trace_after_the_cards_kernels_keeps_its_autograd():
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 8, 32), torch.randint(0, 32, (2, 8))
    with cuda_kernels(GENERIC), cuda_autocast():  # (a trace under the card's kernels, as an estimate's)
        inside, _ = _traced_loss(logits, labels)
    assert inside.requires_grad
    after, leaf = _traced_loss(logits, labels)
    assert after.requires_grad, "the trace after the card's kernels lost its autograd"
    after.backward()
    eager = logits.detach().requires_grad_()
    _loss(eager, labels).backward()
    torch.testing.assert_close(leaf.grad, eager.grad)
