"""Names in a model file that look like a hook and are not one (oomtune/hook_names.py): a missing required hook's
error names the near name; a misspelt optional hook, whose default runs in its place, gets a note in probe and a
warning in train. device: cpu."""

import json

from oomtune.hook_names import did_you_mean, hook_name_notes
from oomtune.model_file import load_model_file

from .conftest import TINY_MODEL, run_cli

PROBE = ("--device", "cpu", "--budget", "64MiB", "--batch", "2", "--context", "4")
MISSPELT = TINY_MODEL + '''
def optimiser(params, lr):
    return torch.optim.SGD(params, lr=lr)

def train_batch(batch_size, context_length, device):
    while True:
        yield make_batch(batch_size, context_length, device)

DEFAULT = {"batch": 2, "context": 4}

def block(width):  # a helper of the file's own: near `blocks`, and said so, with an "if"
    return nn.Linear(width, width)

class Optimizer:  # a class is no hook, near name or not
    pass
'''


def test_a_missing_required_hook_names_the_near_name_the_file_defines(write_model):
    path = write_model(TINY_MODEL.replace("def make_batch(", "def make_batches("))
    r = run_cli("probe", str(path), *PROBE)
    assert r.exit_code == 2
    assert r.stderr.strip().splitlines()[-1] == ("error: model.py: missing required function make_batch() (the file "
                                                  "defines make_batches(): is that it, misspelt?)")
    r = run_cli("probe", str(write_model(TINY_MODEL.replace("def make_batch(", "def sample("), "other.py")), *PROBE)
    assert r.stderr.strip().splitlines()[-1] == "error: other.py: missing required function make_batch()"


def test_a_default_loss_that_fails_beside_a_misspelt_loss_says_so(write_model):
    source = TINY_MODEL.replace("return nn.functional.cross_entropy(self.out(x).mean(1), y)", "return self.out(x)")
    r = run_cli("probe", str(write_model(source + "\ndef losses(model, batch):\n    return model(*batch).mean()\n")),
                *PROBE)
    assert r.exit_code == 2
    assert ("the model returned what looks like logits, of shape (1, 16, 4), not a loss: training needs a loss, a "
            "scalar; rename losses() to loss(), or define loss(model, batch) to compute it") in r.stderr


def test_misspelt_optional_hooks_are_noted_in_probe_and_warned_in_train(write_model, tmp_path):
    """Each would have run the default silently: AdamW for the file's SGD, synthetic data for its own, 32 x 512."""
    mf = load_model_file(write_model(MISSPELT))
    notes = hook_name_notes(mf.label, mf.module)
    assert [n.split(",")[0] for n in notes] == [
        "model.py defines block()", "model.py defines optimiser()", "model.py defines train_batch()",
        "model.py defines DEFAULT"]
    assert notes[1] == ("model.py defines optimiser(), which is no hook oomtune calls: if it is meant as "
                        "optimizer(), rename it (the default is used in its place)")
    out = tmp_path / "best.yaml"
    r = run_cli("probe", str(mf.path), *PROBE, "--out", str(out), "--json")
    assert r.exit_code == 0, r.output
    assert set(notes) <= set(json.loads(r.stdout)["notes"])
    run_dir = tmp_path / "run"
    r = run_cli("train", "--config", str(out), "--steps", "1", "--warmup-steps", "0", "--run-dir", str(run_dir))
    assert r.exit_code == 0, r.output
    assert "warning: model.py defines optimiser(), which is no hook oomtune calls" in r.output


def test_a_file_with_its_hooks_right_gets_no_note():
    """The real hooks, however near to each other (eval_batches / train_batches), are never each other's typo."""
    module = type("M", (), {})()
    for name in ("build_model", "make_batch", "loss", "blocks", "optimizer", "train_batches", "eval_batches"):
        setattr(module, name, lambda *a: None)
    module.DEFAULTS = {}
    module.get_loss = module.configure = lambda *a: None
    assert hook_name_notes("m.py", module) == () and did_you_mean(module, "make_batch") == ""


def test_a_loss_hook_named_with_a_word_of_its_own_is_named(write_model):
    """device: fake. loss_fn() is no misspelling difflib would find (0.73), but holds the hook's one word: the
    default loss's error names it, and the model's tuple is of Tensors, not FakeTensors."""
    source = TINY_MODEL.replace("return nn.functional.cross_entropy(self.out(x).mean(1), y)",
                                "return x, x, self.out(x)")
    path = write_model(source + "\ndef loss_fn(model, batch):\n    return model(*batch)[2].mean()\n")
    r = run_cli("estimate", str(path), "--budget", "400KiB", "--margin", "0", "--batch", "2", "--context", "4")
    assert r.exit_code == 2
    assert r.stderr.strip().splitlines()[-1].endswith(
        "the model returned a tuple of (Tensor, Tensor, Tensor); the default loss takes a scalar, (logits, loss) or "
        "an object with .loss — define loss(model, batch) (the file defines loss_fn(): is that it, misspelt?)")
    mf = load_model_file(path)
    assert hook_name_notes(mf.label, mf.module)[0].startswith("model.py defines loss_fn(), which is no hook")
