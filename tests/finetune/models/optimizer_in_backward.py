"""An optimizer stepped in backward, as PyTorch's tutorial and torchtune's optimizer_in_bwd write it: one AdamW a
parameter, stepped from its post-accumulate-grad hook, the gradient dropped at once. The model is built in fp32
(`.float()`), so a bf16-true plan casts it after the hooks are on. The causal LM of llama3_scaled_rope.py."""

import sys
import weakref
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from llama3_scaled_rope import DEFAULTS, MAX_CONTEXT, VOCAB, Model, make_batch  # noqa: E402, F401

STEPS = []  # one entry a parameter step (the tests count them)
BUILT = weakref.WeakSet()  # every model built, while it lives (the tests check none outlives its search)


def build_model():
    model = Model().float()
    optimizers = {p: torch.optim.AdamW([p], lr=1e-3) for p in model.parameters()}

    def step(p):
        optimizers[p].step()
        optimizers[p].zero_grad(set_to_none=True)
        STEPS.append(1)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    BUILT.add(model)
    return model
