"""The notes on a model's weights' dtypes: a frozen base built in 16 bits under fp32 trained weights (the whole model
in 16 bits: test_probe.py). Device: cpu."""

from oomtune.memory.devices import CpuDevice
from oomtune.model_file import load_model_file
from oomtune.search.options import resolve_targets
from oomtune.search.probe import probe

FROZEN_BF16_BASE = '''
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2)).bfloat16().requires_grad_(False)
        self.out = nn.Linear(16, 4)  # trained, fp32: a LoRA model loaded in bf16 keeps its adapters so

    def forward(self, x, y):
        x = x.bfloat16()
        for b in self.blocks:
            x = torch.relu(b(x))
        return nn.functional.cross_entropy(self.out(x.float()).mean(1), y)

def build_model():
    return Net()

def make_batch(batch_size, context_length, device):
    return (torch.randn(batch_size, context_length, 16, device=device),
            torch.randint(0, 4, (batch_size,), device=device))
'''


def test_a_frozen_base_built_in_bf16_under_fp32_trained_weights_gets_a_note_saying_what_fp32_means(write_model):
    """device: cpu. A base loaded in bf16 with fp32 adapters (PEFT's default) got an 'fp32' plan and no word that its
    frozen weights stay bf16; the whole-model case's note (above) is not the one given, and it keeps its amp rung."""
    mf = load_model_file(write_model(FROZEN_BF16_BASE))
    result = probe(mf, CpuDevice("64MiB"), resolve_targets(mf, 8, 4, None))
    notes = " ".join(result.notes)
    assert "model.py's frozen weights are bfloat16, as build_model() returns them" in notes
    assert "its 'fp32' means no autocast, not fp32 weights" in notes and "trained weights are" not in notes
    assert result.config.plan.precision == "fp32" and result.config.found_by.notes == result.notes
