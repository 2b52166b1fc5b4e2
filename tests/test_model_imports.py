"""Model files as Python imports them: their neighbours, models built with copy.deepcopy on fake tensors, and a
make_batch that ignores its device argument."""

from __future__ import annotations

import json
import sys

import pytest

from oomtune.model_file import load_model_file

from .conftest import TINY_MODEL, run_cli


def test_two_model_files_each_import_their_own_neighbour_of_the_same_name(tmp_path):
    """Two projects' folders, each a model file and a `helpers.py` it imports, loaded one after the other in one
    process (the API, a notebook): each gets its own helpers (the second got the first's from sys.modules), and
    sys.path keeps the folders last, as it was."""
    files = []
    for width in (8, 24):
        folder = tmp_path / f"project{width}"
        folder.mkdir()
        (folder / "helpers.py").write_text(f"WIDTH = {width}\n")
        source = TINY_MODEL.replace("import torch\n", "import torch\nfrom helpers import WIDTH\n", 1)
        (folder / "model.py").write_text(source.replace("nn.Linear(16, 4)", "nn.Linear(16, WIDTH)"))
        files.append(folder / "model.py")
    before = list(sys.path)
    widths = [load_model_file(f).build().out.out_features for f in files]
    assert widths == [8, 24]
    assert sys.path[:len(before)] == before and set(sys.path[len(before):]) == {str(f.parent) for f in files}


def test_a_model_file_imports_its_own_neighbour_not_the_notebooks_of_that_name(tmp_path, monkeypatch):
    """A notebook that imported its own `helpers.py` (here under the name `nb_helpers_probe`), then loads a model
    file whose folder has one of that name: the file silently got the notebook's, and the probe measured another
    model. Now the file imports its own, as `python model.py` would, and the notebook keeps its own."""
    name = "nb_helpers_probe"
    notebook, project = tmp_path / "notebook", tmp_path / "project"
    for folder, width in ((notebook, 5), (project, 24)):
        folder.mkdir()
        (folder / f"{name}.py").write_text(f"WIDTH = {width}\n")
    source = TINY_MODEL.replace("import torch\n", f"import torch\nfrom {name} import WIDTH\n", 1)
    (project / "model.py").write_text(source.replace("nn.Linear(16, 4)", "nn.Linear(16, WIDTH)"))
    monkeypatch.syspath_prepend(str(notebook))
    monkeypatch.delitem(sys.modules, name, raising=False)
    mine = __import__(name)
    assert mine.WIDTH == 5
    assert load_model_file(project / "model.py").build().out.out_features == 24
    assert sys.modules[name] is mine and __import__(name).WIDTH == 5
    monkeypatch.delitem(sys.modules, name)


DEEPCOPIED = '''
import copy
import torch
from torch import nn

class M(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.Linear(64, 64)
        self.blocks = nn.ModuleList([copy.deepcopy(layer) for _ in range(2)])  # as nn.TransformerEncoder does

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.pow(2).mean()

def build_model():
    return M()

def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, context_length, 64, device=device)
'''


def test_a_model_built_with_deepcopy_climbs_to_the_bf16_true_rung_on_fake_tensors(write_model, tmp_path):
    """device: fake. A deep-copied fake parameter is memoised by another converter's memo and describer; the
    bf16-true cast swaps it, which those weak references refused ("Couldn't swap Linear.weight", exit 1)."""
    r = run_cli("estimate", write_model(DEEPCOPIED), "--budget", "80KiB", "--margin", "0", "--batch", "4",
                "--context", "16", "--out", tmp_path / "best.yaml", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["plan"]["precision"] == "bf16-true"


@pytest.mark.parametrize("device_arg, noted", [("", True), (", device=device", False)])
def test_a_make_batch_that_ignores_its_device_is_noted_where_the_cpu_cannot_see_it(device_arg, noted, write_model,
                                                                                    tmp_path):
    """device: fake (estimate) and cpu (probe). Such a make_batch runs here (the device is the CPU) and fails on a
    GPU's probe; a make_batch that reads values (meta tensors have none) is not blamed."""
    source = TINY_MODEL.replace("torch.randn(batch_size, context_length, 16, device=device)",
                                f"torch.randn(batch_size, context_length, 16{device_arg})")
    assert (source != TINY_MODEL) is noted
    model = write_model(source)
    said = "model.py's make_batch() ignores its device argument"
    for args in (("estimate", model, "--budget", "400KiB", "--margin", "0"),
                 ("probe", model, "--device", "cpu", "--budget", "64MiB")):
        r = run_cli(*args, "--batch", "2", "--context", "4", "--out", tmp_path / "best.yaml", "--json")
        assert r.exit_code == 0, r.output
        assert any(said in n for n in json.loads(r.stdout)["notes"]) is noted
    one = run_cli("estimate", model, "--budget", "400KiB", "--margin", "0", "--micro-batch", "2", "--context", "4",
                  "--json")  # one plan (what_if)
    assert one.exit_code == 0 and any(said in n for n in json.loads(one.stdout)["notes"]) is noted, one.output
    reads = write_model(source.replace("def make_batch(batch_size, context_length, device):",
                                       "def make_batch(batch_size, context_length, device):\n"
                                       "    assert torch.ones(1, device=device).item() == 1"), "reads.py")
    from oomtune.memory.devices import CpuDevice
    from oomtune.search.batch_notes import batch_notes

    assert load_model_file(reads).sample_tensors(4)[1] is False  # (drawn on the cpu, not on meta)
    assert not any("ignores its device" in n for n in batch_notes(load_model_file(reads), CpuDevice("1GiB"), 4))


def test_a_make_batch_shorter_than_the_context_is_noted(write_model, tmp_path):
    """device: fake. Padding to the longest in the batch (lengths up to a quarter of the context, read with .item(),
    so it runs on the cpu, not on meta): the plan is sized for short sequences, and real data at full length may
    not fit. The full-length batch of the same model gets no such note."""
    head = "def make_batch(batch_size, context_length, device):\n"
    short = TINY_MODEL.replace(head, head + "    context_length = int(torch.randint(1, context_length // 4 + 1, "
                                            "()).item())\n")
    assert short != TINY_MODEL
    said = "make_batch(batch_size, 64, device) returned no tensor with a dimension of 64"
    for source, noted in ((short, True), (TINY_MODEL, False)):
        r = run_cli("estimate", write_model(source), "--budget", "400KiB", "--margin", "0", "--batch", "2",
                    "--context", "64", "--out", tmp_path / "best.yaml", "--json")
        assert r.exit_code == 0, r.output
        assert any(said in n for n in json.loads(r.stdout)["notes"]) is noted


def test_a_make_batch_that_ignores_its_batch_size_is_bad_input(write_model, tmp_path):
    """device: cpu and fake. It returned 8 examples whatever it was asked for: the probe climbed every rung and
    reported micro-batch 32 where each trial had run 8 (exit 0). Now one line, exit 2, and no config written."""
    head = "def make_batch(batch_size, context_length, device):\n"
    fixed = TINY_MODEL.replace(head, head + "    batch_size = 8\n")
    assert fixed != TINY_MODEL
    model = write_model(fixed)
    for args in (("estimate", model, "--budget", "400KiB", "--margin", "0"),
                 ("probe", model, "--device", "cpu", "--budget", "64MiB")):
        r = run_cli(*args, "--batch", "4", "--context", "4", "--out", tmp_path / "best.yaml")
        assert r.exit_code == 2, r.output
        assert "make_batch() returned the same shapes for batch_size 1 and 2 ((8, 4, 16)" in " ".join(r.stderr.split())
        assert not (tmp_path / "best.yaml").exists()


def test_deep_copied_layers_count_once_on_fake_tensors(write_model):
    """devices: cpu and fake. copy.deepcopy copied each fake parameter's fake mode with it; the mode the trial ran in
    converted those foreign tensors at each op onto storages of their own, and the fake device counted every copied
    weight twice from the first forward on (+2 x 16 KiB here; +1 MiB on a user's 4-layer MLP, GiBs on a large
    nn.TransformerEncoder). Each phase's peak now equals the cpu device's, to the byte, and the copies share the
    trial's mode."""
    from oomtune.config.schema import Plan
    from oomtune.memory.devices import CpuDevice, FakeDevice
    from oomtune.memory.margin import Margin
    from oomtune.search.trial import run_trial

    mf = load_model_file(write_model(DEEPCOPIED))
    for precision in ("fp32", "bf16"):
        plan = Plan(4, 16, precision)
        cpu = run_trial(mf, plan, CpuDevice("1GiB"))
        fake = run_trial(mf, plan, FakeDevice("1GiB", margin=Margin()))
        assert fake.phase_peaks == cpu.phase_peaks and fake.peak_bytes == cpu.peak_bytes, precision
    device = FakeDevice("1GiB", margin=Margin())
    with device.measure():
        model = mf.build()
        assert len({id(p.fake_mode) for p in model.parameters()}) == 1


def test_an_all_ones_attention_mask_is_noted_only_for_a_transformers_model(write_model):
    """device: cpu (make_batch's values). The note is about transformers dropping the mask: a model file of its own
    attention (nn.MultiheadAttention with a key_padding_mask measures the same with any mask) gets none."""
    from oomtune.memory.devices import CpuDevice
    from oomtune.search.batch_notes import batch_notes

    source = '''
import torch
from torch import nn

def build_model():
    return nn.Linear(4, 4)

def make_batch(batch_size, context_length, device):
    x = torch.randn(batch_size, context_length, 4, device=device)
    return {"x": x, "attention_mask": torch.ones(batch_size, context_length, device=device)}

def loss(model, batch):
    return (model(batch["x"]) * batch["attention_mask"][..., None]).square().mean()
'''
    plain = load_model_file(write_model(source, name="plain.py"))
    assert not any("attention_mask" in n for n in batch_notes(plain, CpuDevice("1GiB"), 8))
    # (a transformers model's all-ones mask is noted: tests/finetune/test_model_kinds.py, with a real BERT)
