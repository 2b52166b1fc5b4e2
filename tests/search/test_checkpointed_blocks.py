"""Which blocks activation checkpointing wraps, and a checkpointing rung that would save nothing: a layer kept as a
ModuleList of its parts (vit-pytorch's shape: tests/search/models/paired_layers.py), blocks whose forward never
runs, blocks that run but hold no activations. Device: fake (estimate)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from oomtune.memory.breakdown import static_memory
from oomtune.model_file import load_model_file
from tests.conftest import TINY_MODEL, run_cli

PAIRED = Path(__file__).parent / "models" / "paired_layers.py"


def _estimate(path, out, *args: str) -> dict:
    r = run_cli("estimate", path, "--margin", "0", "--out", out, "--json", *args)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _peaks(report: dict, rung: str) -> dict[int, int]:
    return {t["micro_batch_size"]: t["peak_bytes"] for t in report["trials"]
            if t["rung"] == rung and t["peak_bytes"] and t["grad_accum_steps"] == 1}


def test_a_layer_kept_as_a_modulelist_of_its_parts_is_checkpointed_by_its_parts(tmp_path):
    """device: fake. The outer list's items are ModuleLists that are never called (the encoder unpacks each into its
    attention and feed-forward): the default wrapped them, and the checkpointing rung measured exactly the amp rung's
    peaks (14 a micro-batch at most on both; plan 8x8). The parts are wrapped now: at the same micro-batch its peak is
    lower, and it fits micro-batches the amp rung does not."""
    mf = load_model_file(PAIRED)
    blocks = mf.blocks(mf.build())
    assert [type(b).__name__ for b in blocks] == ["SelfAttention", "MLP"] * 4
    assert static_memory(mf).blocks_wrapped == "8 blocks (SelfAttention x4, MLP x4)"
    report = _estimate(PAIRED, tmp_path / "e.yaml", "--budget", "6MiB")
    amp, ckpt = _peaks(report, "amp"), _peaks(report, "checkpointing")
    both = max(set(amp) & set(ckpt))  # the ladder's target micro-batch, which each rung tries first
    assert ckpt[both] < amp[both]
    best = {r["rung"]: r["micro_batch_size"] for r in report["rungs"]}
    assert best["amp"] == 14 and best["checkpointing"] == 43
    assert not any("saved nothing" in n for n in report["notes"])


PARTS_CALLED = TINY_MODEL.replace("        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))\n", """\
        self.blocks = nn.ModuleList(Layer() for _ in range(2))
""").replace("            x = torch.relu(b(x))\n", """\
            x = x + b.mix(torch.relu(b.norm(x)))  # the parts, not the layer: Layer.forward never runs
""").replace("class Net(nn.Module):", """\
class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.mix = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x):
        return x + self.mix(torch.relu(self.norm(x)))

class Net(nn.Module):""")


def test_blocks_whose_forward_never_runs_get_no_checkpointing_rung_and_a_note(write_model, tmp_path):
    """device: fake. The list's layers have a forward, but the model calls their parts: checkpointing wrapped
    nothing that runs, and its rung measured the amp rung's peaks again. A first forward on fake tensors sees that
    none runs: no rung, a note naming what it would have wrapped and the hook to define."""
    path = write_model(PARTS_CALLED)
    static = static_memory(load_model_file(path))
    assert not static.checkpointing_supported and static.checkpointing_idle == "2 blocks (Layer x2)"
    report = _estimate(path, tmp_path / "e.yaml", "--budget", "400KiB", "--batch", "64", "--context", "64")
    assert [r["rung"] for r in report["rungs"]] == ["fp32", "amp"]
    note = ("no activation checkpointing rung: model.py's forward runs none of the 2 blocks (Layer x2) it would "
            "wrap, so it would save nothing; define blocks(model) returning the modules the forward calls")
    assert any(n.startswith(note) for n in report["notes"]), report["notes"]
    assert yaml.safe_load((tmp_path / "e.yaml").read_text())["found_by"]["notes"] == report["notes"]
    r = run_cli("estimate", path, "--budget", "1GiB", "--micro-batch", "2", "--context", "8", "--checkpointing")
    assert r.exit_code == 2 and "its forward runs none of the 2 blocks (Layer x2) it would wrap" in r.stderr


NOTHING_SAVED = TINY_MODEL.replace("        self.out = nn.Linear(16, 4)\n", """\
        self.out = nn.Linear(16, 4)
        self.scale = Scale()
""").replace("        for b in self.blocks:\n", """\
        x = x * self.scale()
        for b in self.blocks:
""").replace("class Net(nn.Module):", """\
class Scale(nn.Module):  # a constant from a buffer: nothing of it is saved for backward
    def __init__(self):
        super().__init__()
        self.register_buffer("value", torch.ones(16))

    def forward(self):
        return self.value * 0.5

class Net(nn.Module):""") + """
def blocks(model):
    return [model.scale]
"""


def test_a_checkpointing_rung_whose_peaks_equal_the_rung_before_gets_a_note(write_model, tmp_path):
    """device: fake. The blocks hook's module runs but holds none of the activations: the checkpointing rung's peaks
    are the amp rung's at every size both measured, and the output and the config's notes say so, naming what it
    wraps and the hook; a model whose checkpointing saves memory (the paired layers, above) gets no such note."""
    path = write_model(NOTHING_SAVED)
    report = _estimate(path, tmp_path / "e.yaml", "--budget", "400KiB", "--batch", "64", "--context", "64")
    amp, ckpt = _peaks(report, "amp"), _peaks(report, "checkpointing")
    assert len(set(amp) & set(ckpt)) >= 2 and all(amp[b] == ckpt[b] for b in set(amp) & set(ckpt))
    note = next(n for n in report["notes"] if "saved nothing" in n)
    assert note.startswith("the checkpointing rung saved nothing: at every size both it and the amp rung measured "
                           "(micro-batch ")
    assert ("its peak equals the amp rung's to the byte, so the 1 block (Scale x1) it wraps hold none of the "
            "activations; define blocks(model) in model.py") in note
    assert note in yaml.safe_load((tmp_path / "e.yaml").read_text())["found_by"]["notes"]
