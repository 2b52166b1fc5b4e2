"""The model-file contract: required hooks, default hooks, and one clear line + exit 2 for every bad input."""

import pytest
import torch
from torch import nn

from oomtune.errors import ModelFileError
from oomtune.model_file import load_model_file

from .conftest import EXAMPLES, TINY_MODEL, run_cli

PROBE = ("probe", "--device", "cpu", "--budget", "64MiB", "--batch", "2", "--context", "4")


def probe_error(model_path, *extra):
    """Run `oomtune probe` on a bad model file: exit 2, one error line (the last on stderr) naming the problem."""
    r = run_cli(*PROBE[:1], model_path, *PROBE[1:], *extra)
    assert r.exit_code == 2, r.output
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and r.stderr.strip().splitlines()[-1] == errors[0], r.stderr
    assert "Traceback" not in r.output
    return errors[0]


def test_missing_file(tmp_path):
    assert probe_error(tmp_path / "nope.py") == f"error: model file not found: {tmp_path / 'nope.py'}"


def test_syntax_error_names_the_line(write_model):
    path = write_model("def build_model(:\n    pass\n")
    assert probe_error(path).startswith("error: model.py: syntax error at line 1")


def test_missing_build_model(write_model):
    path = write_model("def make_batch(b, t, device):\n    return None\n")
    assert probe_error(path) == "error: model.py: missing required function build_model()"


def test_make_batch_returning_the_wrong_type(write_model):
    path = write_model(TINY_MODEL.replace("return (torch.randn", "return 42 or (torch.randn"))
    msg = probe_error(path)
    assert msg.startswith("error: model.py: make_batch() returned an int; expected a Tensor, a tuple/list")


def test_loss_that_is_not_a_scalar(write_model):
    path = write_model(TINY_MODEL + "\ndef loss(model, batch):\n    return model.out(batch[0])\n")
    assert probe_error(path) == ("error: model.py: loss gave a tensor of shape (2, 4, 4); expected a scalar "
                                 "(reduce it, e.g. .mean())")


def test_non_finite_loss(write_model):
    path = write_model(TINY_MODEL + "\ndef loss(model, batch):\n    return model(*batch) * float('nan')\n")
    msg = probe_error(path)
    assert msg.startswith("error: model.py: the loss is nan at micro-batch")


def test_user_bug_aborts_the_probe_with_the_users_error(write_model):
    path = write_model(TINY_MODEL.replace("nn.Linear(16, 4)", "nn.Linear(8, 4)"))
    msg = probe_error(path)
    assert msg.startswith("error: model.py: the model's forward raised RuntimeError: mat1 and mat2 shapes")


def test_budget_too_small_for_the_weights_says_what_they_need(write_model):
    msg = probe_error(write_model(), "--budget", "2KiB")
    # 3 Linear(16, x): weights 3 x (1024 + 512 bias blocks) ... the exact figures come from the tracker
    assert "too small for the weights alone: weights " in msg
    assert "+ gradients " in msg and "+ AdamW state " in msg


def test_bad_defaults_and_bad_options(write_model):
    path = write_model(TINY_MODEL + "\nDEFAULTS = {'batchsize': 4}\n")
    assert "DEFAULTS has unknown key 'batchsize'" in probe_error(path)
    assert probe_error(write_model(), "--min-context", "8") == "error: --min-context 8 is longer than --context 4"
    assert probe_error(write_model(), "--budget", "lots").startswith("error: budget 'lots': expected a size")


# -- default hooks -----------------------------------------------------------------------------------------

def test_default_loss_takes_a_scalar_a_tuple_or_an_object_with_loss(write_model):
    for forward_returns in ("loss", "(x, loss)", "types.SimpleNamespace(logits=x, loss=loss)", "{'loss': loss}"):
        src = TINY_MODEL.replace(
            "return nn.functional.cross_entropy(self.out(x).mean(1), y)",
            f"loss = nn.functional.cross_entropy(self.out(x).mean(1), y)\n        return {forward_returns}",
        )
        mf = load_model_file(write_model("import types\n" + src, name=f"m{abs(hash(forward_returns))}.py"))
        model = mf.build()
        loss = mf.loss(model, mf.batch(2, 3, torch.device("cpu")))
        assert loss.dim() == 0 and loss.requires_grad


def test_default_loss_explains_an_output_it_cannot_read(write_model):
    src = TINY_MODEL.replace("return nn.functional.cross_entropy(self.out(x).mean(1), y)", "return [x, x, x]")
    mf = load_model_file(write_model(src))
    with pytest.raises(ModelFileError, match="the model returned a list of .*define loss\\(model, batch\\)"):
        mf.loss(mf.build(), mf.batch(2, 3, torch.device("cpu")))


def test_default_blocks_is_the_longest_modulelist_of_one_type():
    mf = load_model_file(EXAMPLES / "tiny_gpt.py")
    model = mf.build()
    assert mf.blocks(model) == list(model.h)

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.mixed = nn.ModuleList([nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.Tanh()])  # longer, mixed
            self.layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])

    m = Mixed()
    assert mf.blocks(m) == list(m.layers)


def test_checkpointing_wraps_blocks_and_keeps_gradients_identical():
    mf = load_model_file(EXAMPLES / "tiny_gpt.py")
    torch.manual_seed(0)
    plain = mf.build()
    ckpt = mf.build()
    ckpt.load_state_dict(plain.state_dict())
    mf.enable_checkpointing(ckpt)
    batch = mf.batch(2, 16, torch.device("cpu"))
    for m in (plain, ckpt):
        mf.loss(m, batch).backward()
    for p, q in zip(plain.parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_hugging_face_models_checkpoint_through_their_own_switch(write_model):
    src = TINY_MODEL.replace("class Net(nn.Module):", '''class Net(nn.Module):
    calls = []

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        Net.calls.append(gradient_checkpointing_kwargs)
''')
    mf = load_model_file(write_model(src))
    model = mf.build()
    mf.enable_checkpointing(model)
    assert mf.module.Net.calls == [{"use_reentrant": False}]


def test_optional_hooks_override_defaults(write_model):
    src = TINY_MODEL + '''
def optimizer(params, lr):
    return torch.optim.SGD(params, lr=lr)

def blocks(model):
    return [model.out]

DEFAULTS = {"batch": 8, "context": 64, "min_context": 16}
'''
    mf = load_model_file(write_model(src))
    model = mf.build()
    assert isinstance(mf.optimizer(model.parameters(), 0.1), torch.optim.SGD)
    assert mf.blocks(model) == [model.out]
    assert mf.defaults == {"batch": 8, "context": 64, "min_context": 16}
