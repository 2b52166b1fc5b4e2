"""The model-file contract: required hooks, default hooks, and one clear line + exit 2 for every bad input."""

import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from oomtune.errors import ModelFileError
from oomtune.memory.breakdown import static_memory
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


def test_a_nul_byte_is_a_syntax_error_without_a_line(write_model):
    path = write_model("def build_model():\n    pass\n\0\n")
    msg = probe_error(path)
    assert msg.startswith("error: model.py: syntax error: ") and "None" not in msg


def test_missing_build_model(write_model):
    path = write_model("def make_batch(b, t, device):\n    return None\n")
    assert probe_error(path) == "error: model.py: missing required function build_model()"
    path = write_model("build_model = 5\ndef make_batch(b, t, device):\n    return None\n")
    assert probe_error(path) == "error: model.py: build_model must be a function, got int 5"


def test_make_batch_returning_the_wrong_type(write_model):
    path = write_model(TINY_MODEL.replace("return (torch.randn", "return 42 or (torch.randn"))
    msg = probe_error(path)
    assert msg.startswith("error: model.py: make_batch() returned an int; expected a Tensor, a tuple/list")


@pytest.mark.parametrize(("empty", "kind"), [("{}", "dict"), ("()", "tuple"), ("[]", "list")])
def test_make_batch_returning_an_empty_container_says_so(write_model, empty, kind):
    path = write_model(TINY_MODEL + f"\ndef make_batch(batch_size, context_length, device):\n    return {empty}\n")
    assert probe_error(path) == f"error: model.py: make_batch() returned an empty {kind}"


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


def test_a_model_error_on_fake_tensors_prints_no_torch_traceback(tmp_path):
    """torch's fake_tensor logger logs its own traceback before raising; only our one line may reach stderr.
    A subprocess: the logger's handler holds the real stderr, and importing torch resets its level."""
    path = tmp_path / "shape.py"
    path.write_text(TINY_MODEL.replace("nn.Linear(16, 4)", "nn.Linear(8, 4)"))
    cmd = [sys.executable, "-m", "oomtune", "estimate", str(path), "--budget", "1GiB", "--batch", "4",
           "--context", "16"]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "fake_tensor" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: shape.py: the model's forward raised RuntimeError")


@pytest.mark.parametrize(("hook", "message"), [
    ("return None", "blocks() returned None; expected an iterable of nn.Module"),
    ("return []", "blocks() returned an empty list; expected at least one nn.Module"),
    ("return [model.out, 'out']", "blocks() returned a str among its items; expected only nn.Module objects"),
    ("return model.out", "blocks() returned a Linear; expected an iterable of nn.Module"),
    ("raise KeyError('h')", "blocks() raised KeyError: 'h'"),
    ("return [nn.Linear(16, 16)]", "blocks() returned modules that are not in the model (1 of 1): return "
     "submodules of the model it is given"),
    ("return list(Net().blocks)", "blocks() returned modules that are not in the model (2 of 2)"),
    ("return [model.out, nn.Linear(1, 1)]", "blocks() returned modules that are not in the model (1 of 2)"),
    ("return [model]", "blocks() returned the model itself: checkpointed whole"),
])
def test_a_bad_blocks_hook_fails_before_any_trial(write_model, hook, message):
    path = write_model(TINY_MODEL + f"\ndef blocks(model):\n    {hook}\n")
    with pytest.raises(ModelFileError, match=re.escape(f"model.py: {message}")):
        static_memory(load_model_file(path))  # the floor, measured before the first rung
    msg = probe_error(path)
    assert msg.startswith(f"error: model.py: {message}"), msg


@pytest.mark.parametrize("hook", ["model.blocks", "model._orig_mod.blocks"])
def test_blocks_of_a_compiled_model_are_in_the_model(write_model, hook):
    """A guard for the not-in-the-model check: torch.compile's OptimizedModule forwards attributes to `_orig_mod`,
    whose modules are among its own."""
    mf = load_model_file(write_model(TINY_MODEL + f"\ndef blocks(model):\n    return {hook}\n"))
    model = mf.build()
    compiled = torch.compile(model)  # lazy: nothing compiles until it is called
    assert mf.blocks(compiled) == list(model.blocks)
    assert mf.supports_checkpointing(compiled)


@pytest.mark.parametrize(("where", "source", "message"), [
    ("module level", "import sys\nsys.exit(3)\n" + TINY_MODEL, "importing it called sys.exit(3)"),
    ("build_model", TINY_MODEL.replace("    return Net()", "    import sys; sys.exit('bye')"),
     "build_model() called sys.exit('bye')"),
    ("forward", TINY_MODEL.replace("x = torch.relu(b(x))", "raise SystemExit"),
     "the model's forward called sys.exit()"),
])
def test_sys_exit_in_the_model_file_is_a_model_file_error(write_model, where, source, message):
    assert probe_error(write_model(source)) == f"error: model.py: {message}", where


def test_budget_too_small_for_the_weights_says_what_they_need(write_model):
    msg = probe_error(write_model(), "--budget", "2KiB", "--levers", "amp,checkpointing,accumulation")
    # 3 Linear(16, x): weights 3 x (1024 + 512 bias blocks) ... the exact figures come from the tracker
    assert "too small for the weights alone: weights " in msg
    assert "+ gradients " in msg and "+ AdamW state " in msg
    # with the levers past accumulation the floor is what is left with all of them applied, and it says so (not 8-bit
    # AdamW: it quantizes none of these small tensors, so its state would be bf16-true's)
    msg = probe_error(write_model(), "--budget", "2KiB")
    assert "too small for the weights alone: weights 3.00 KiB + gradients 0 B + AdamW state 0 B" in msg
    assert msg.endswith("(with bf16-true+offload+offload-activations; and 15.00 KiB in host memory)")
    # the error is all it says: no "probing ..." header first, as if a search had begun
    r = run_cli(*PROBE[:1], write_model(), *PROBE[1:], "--budget", "2KiB")
    assert r.stderr.strip() == msg, r.stderr


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
        assert loss.dim() == 0 and loss.requires_grad, forward_returns


def test_default_loss_says_it_takes_the_loss_second(write_model):
    """(loss, logits) read "the default loss gave a tensor of shape ...; expected a scalar". It is not taken as the
    loss either way round: at micro-batch 1 a squeezed prediction is a scalar too, and would train silently."""
    src = TINY_MODEL.replace("return nn.functional.cross_entropy(self.out(x).mean(1), y)",
                             "return nn.functional.cross_entropy(self.out(x).mean(1), y), x")
    mf = load_model_file(write_model(src))
    with pytest.raises(ModelFileError, match=r"returned \(a scalar, a tensor of shape \(2, 3, 16\)\): the default loss "
                                             r"takes \(logits, loss\), the loss second"):
        mf.loss(mf.build(), mf.batch(2, 3, torch.device("cpu")))


def test_default_loss_explains_an_output_it_cannot_read(write_model):
    src = TINY_MODEL.replace("return nn.functional.cross_entropy(self.out(x).mean(1), y)", "return [x, x, x]")
    mf = load_model_file(write_model(src))
    with pytest.raises(ModelFileError, match="the model returned a list of .*define loss\\(model, batch\\)"):
        mf.loss(mf.build(), mf.batch(2, 3, torch.device("cpu")))
    no_labels = TINY_MODEL.replace("return nn.functional.cross_entropy(self.out(x).mean(1), y)",
                                   "return types.SimpleNamespace(logits=x, loss=None)")  # HF without labels
    mf = load_model_file(write_model("import types\n" + no_labels, name="nolabels.py"))
    with pytest.raises(ModelFileError, match="whose loss is None .*add a 'labels' entry"):
        mf.loss(mf.build(), mf.batch(2, 3, torch.device("cpu")))


def test_default_blocks_are_every_stack_of_one_type_of_module():
    """An encoder's and a decoder's layers are two stacks (both wrapped); a ModuleList of mixed modules is none; two
    small heads beside them (under a quarter of the largest stack's parameters) are not blocks; a list inside a block
    is part of that block."""
    mf = load_model_file(EXAMPLES / "tiny_gpt.py")
    model = mf.build()
    assert mf.blocks(model) == list(model.h)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):  # (a Layer with no forward could not be called: its parts would be the blocks)
            return self.inner[1](self.inner[0](x))

    class EncoderDecoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.mixed = nn.ModuleList([nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2)])
            self.encoder = nn.ModuleList(Layer() for _ in range(3))
            self.decoder = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
            self.heads = nn.ModuleList(nn.Linear(8, 1) for _ in range(2))

    m = EncoderDecoder()
    assert mf.blocks(m) == [*m.encoder, *m.decoder]


def test_checkpointing_recomputes_every_block_in_backward_and_keeps_gradients_identical():
    """Device: cpu. Each block's inner layers run once per step without checkpointing and twice with it (the forward,
    then the recompute in backward): counted by forward hooks on a layer inside every block, which a checkpoint that
    did nothing would leave at one call."""
    mf = load_model_file(EXAMPLES / "tiny_gpt.py")
    torch.manual_seed(0)
    plain = mf.build()
    ckpt = mf.build()
    ckpt.load_state_dict(plain.state_dict())
    mf.enable_checkpointing(ckpt)
    batch = mf.batch(2, 16, torch.device("cpu"))
    runs = {}
    for name, m in (("plain", plain), ("ckpt", ckpt)):
        calls = [0] * len(m.h)
        for i, block in enumerate(m.h):
            block.attn.qkv.register_forward_hook(lambda *_, i=i, calls=calls: calls.__setitem__(i, calls[i] + 1))
        loss = mf.loss(m, batch)
        forward_only = list(calls)
        loss.backward()
        runs[name] = (forward_only, calls)
    assert runs["plain"] == ([1, 1, 1, 1], [1, 1, 1, 1])
    assert runs["ckpt"] == ([1, 1, 1, 1], [2, 2, 2, 2])  # recomputed in backward, once per block
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
    assert isinstance(mf.optimizer(list(model.parameters()), 0.1), torch.optim.SGD)
    assert mf.blocks(model) == [model.out]
    assert mf.defaults == {"batch": 8, "context": 64, "min_context": 16}


def test_an_optimizer_over_none_of_the_trained_parameters_is_one_line(write_model):
    """A hook that builds its optimizer over other tensors (a typo, a stale list) trained nothing, without a word."""
    msg = probe_error(write_model(TINY_MODEL + '''
def optimizer(params, lr):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
'''))
    assert msg.startswith("error: model.py: optimizer() returned an optimizer over none of the 6 trained parameters")


def test_an_optimizer_hook_that_takes_the_model_gets_it_and_groups_parameters_by_name(write_model, tmp_path):
    """device: cpu. nanoGPT's configure_optimizers needs the model (decay for matrices, none for biases and norms):
    a three-argument hook is called with it, in the probe's trials and in training."""
    src = TINY_MODEL + '''
SEEN = []

def optimizer(params, lr, model):
    params = set(params)  # the trainable ones
    named = [(n, p) for n, p in model.named_parameters() if p in params]
    SEEN.append(sorted(n for n, _ in named))
    return torch.optim.AdamW([{"params": [p for n, p in named if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}], lr=lr)
'''
    mf = load_model_file(write_model(src))
    model = mf.build()
    opt = mf.optimizer([p for p in model.parameters() if p.requires_grad], 1e-3, model)
    assert [len(g["params"]) for g in opt.param_groups] == [3, 3]  # 3 weights, 3 biases
    assert mf.module.SEEN == [["blocks.0.bias", "blocks.0.weight", "blocks.1.bias", "blocks.1.weight", "out.bias",
                               "out.weight"]]
    r = run_cli("probe", mf.path, "--device", "cpu", "--budget", "64MiB", "--batch", "2", "--context", "4",
                "--out", tmp_path / "best.yaml")
    assert r.exit_code == 0, r.output


def test_an_error_inside_backward_is_the_model_files_one_line_exit_2(write_model):
    """device: cpu. A custom autograd Function that fails in backward (as a checkpoint recompute mismatch does)."""
    src = TINY_MODEL.replace("        return nn.functional.cross_entropy(", '''        x = Broken.apply(x)
        return nn.functional.cross_entropy(''') + '''

class Broken(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("recomputed tensors do not match")
'''
    line = probe_error(write_model(src))
    assert line == ("error: model.py: the backward pass of the model raised RuntimeError: recomputed tensors do not "
                    "match (in the trial of micro-batch 2, context 4, fp32)")


def test_a_sparse_embedding_is_named_in_one_line(write_model):
    """device: cpu. nn.Embedding(sparse=True) ended in a screen of NotImplementedError from the gradient clipping
    ('linalg_vector_norm' on SparseCPU, exit 1); with SparseAdam as its optimizer(), in "SparseAdam does not support
    dense gradients" (the floor's zero gradients)."""
    head = "        self.out = nn.Linear(16, 4)\n"
    frozen = TINY_MODEL.replace(head, head + "        self.ids = nn.Embedding(50, 16, sparse=True).requires_grad_("
                                             "False)\n")  # a frozen one never gets a gradient: fine
    assert load_model_file(write_model(frozen, name="frozen.py")).build() is not None
    source = TINY_MODEL.replace(head, head + "        self.ids = nn.Embedding(50, 16, sparse=True)\n")
    assert probe_error(write_model(source)) == (
        "error: model.py: build_model() returned a model whose ids has sparse=True: sparse gradients are not supported "
        "(the training step clips the gradients' norm, and the memory levers need dense ones): build it with "
        "sparse=False")
    functional = TINY_MODEL.replace(head, head + "        self.table = nn.Parameter(torch.randn(50, 16))\n").replace(
        "        for b in self.blocks:",
        "        x = x + nn.functional.embedding(y[:, None], self.table, sparse=True)\n"  # (build() cannot see it)
        "        for b in self.blocks:")
    assert probe_error(write_model(functional, name="functional.py")) == (
        "error: functional.py: backward gave table a sparse gradient (sparse=True in F.embedding or the like?): "
        "sparse gradients are not supported (the training step clips their norm, and the memory levers need dense "
        "ones)")


def test_make_batch_may_nest_its_tensors(write_model):
    """device: cpu and fake. A dict of dicts and tuples (a multimodal batch) was refused as 'a dict with no tensors
    in it'; its leaves are the batch, off-device ones named as at the top level."""
    nested = TINY_MODEL.replace("    def forward(self, x, y):", "    def forward(self, inputs, targets):\n"
                                "        x, y = inputs['x']['values'], targets[0][0]").replace(
        "    return (torch.randn(batch_size, context_length, 16, device=device),\n"
        "            torch.randint(0, 4, (batch_size,), device=device))",
        "    return {'inputs': {'x': {'values': torch.randn(batch_size, context_length, 16, device=device)}},\n"
        "            'targets': ([torch.randint(0, 4, (batch_size,), device=device)],)}")
    path = write_model(nested)
    for device in ("cpu", "fake"):
        r = run_cli("probe", path, "--device", device, "--budget", "1MiB", "--margin", "0", "--batch", "4",
                    "--context", "8", "--out", path.with_name(f"{device}.yaml"))
        assert r.exit_code == 0, r.output
    off = write_model(nested.replace("torch.randint(0, 4, (batch_size,), device=device)",
                                     "torch.randint(0, 4, (batch_size,), device='meta')"), name="off.py")
    assert "make_batch() returned a tensor on meta" in probe_error(off)
    empty = write_model(nested.replace("return {'inputs'", "return {'nothing': {}, 'inputs'").replace(
        "{'values': torch.randn(batch_size, context_length, 16, device=device)}", "{}").replace(
        "[torch.randint(0, 4, (batch_size,), device=device)]", "[]"), name="empty.py")
    assert probe_error(empty) == "error: empty.py: make_batch() returned a dict with no tensors in it"


def test_a_model_built_on_the_meta_device_is_named_in_one_line(write_model):
    """device: cpu and fake. Weights on PyTorch's meta device (built under torch.device("meta") for a fast init
    and never materialized) failed the cpu probe with 'Cannot copy out of meta tensor' (exit 1), and estimate wrote
    a plan that could not train."""
    path = write_model(TINY_MODEL.replace("    return Net()", "    with torch.device('meta'):\n        return Net()"))
    line = ("error: model.py: build_model() returned a model with weights on the meta device, which hold no data: "
            "build it on a real device (or call to_empty() and initialize it)")
    assert probe_error(path) == line
    assert probe_error(path, "--device", "fake", "--margin", "0") == line
