"""A rung's floor (the static memory with its levers: weights, gradients, optimizer state, the step's scratch, what
is offloaded to the host) made from the model with 2, 3 and 4 of its repeated blocks (rung_floors.RungFloors with
the estimate's BlockTrials, extrapolate.extrapolated_static): every figure equals the whole model's measurement;
where a figure is off its line nothing is made and the floor is measured whole. Device: fake (static_memory)."""

from __future__ import annotations

import dataclasses

import pytest

from oomtune.memory.breakdown import StaticMemory, static_memory
from oomtune.model_file import load_model_file
from oomtune.search.extrapolate import BlockTrials, extrapolated_static
from oomtune.search.ladder import Rung
from oomtune.search.rung_floors import RungFloors, floor_plan

from .test_block_extrapolation import MODELS, ROOT, _deeper

FP32 = Rung("fp32", "fp32", True)
TRUE = Rung("bf16-true", "bf16-true", True)
EIGHT_OFFLOAD = Rung("bf16-true+8bit+offload", "bf16-true", True, optimizer_8bit=True, offload_optimizer=True)
NF4 = Rung("bf16-true+8bit+nf4", "bf16-true", True, optimizer_8bit=True, nf4_frozen_weights=True)
IN_BWD = Rung("step-in-backward", "fp32", False, optimizer_in_backward=True)
CASES = [  # (model file, layers, rung)
    (ROOT / "examples" / "tiny_gpt.py", 9, EIGHT_OFFLOAD),
    (MODELS / "hf_llama_lora.py", 6, TRUE),
    (MODELS / "hf_llama_lora.py", 6, IN_BWD),
    ("wide", 6, NF4),
    (MODELS / "hf_mistral_lora_all.py", 6, EIGHT_OFFLOAD),
    (MODELS / "hf_llama_loha.py", 6, FP32),
]


def _sorted(static: StaticMemory) -> StaticMemory:
    return dataclasses.replace(static, trained_sizes=tuple(sorted(static.trained_sizes)))


@pytest.mark.parametrize(("source", "layers", "rung"), CASES,
                         ids=lambda c: c if isinstance(c, str) else getattr(c, "stem", getattr(c, "name", None)))
def test_a_floor_made_from_fewer_blocks_is_the_whole_models(tmp_path, source, layers, rung):
    """Every field of the made floor equals the whole model's static_memory (the trained parameters' sizes as a
    multiset: their order is not kept) but the optimizer step's scratch, left out (0: a bound under the floor), and
    the floor was made, not measured whole."""
    wide = source == "wide"  # the LoRA Llama, wide enough for NF4
    path = _deeper(tmp_path, MODELS / "hf_llama_lora.py" if wide else source, layers, wide)
    mf = load_model_file(path)
    static = dataclasses.replace(static_memory(mf), bf16_weights_bytes=0)  # (no bound passes a rung before its floor)
    floors = RungFloors(mf, static, BlockTrials(min_blocks=5))
    made = floors.floor(rung)
    assert floors.extrapolated == {floor_plan(rung)} and floors.blocks.blocks == layers
    whole = static_memory(mf, floor_plan(rung), rung.name, checks=False)
    assert made.step_temporaries_bytes == 0
    assert _sorted(made) == _sorted(dataclasses.replace(whole, step_temporaries_bytes=0))
    assert made.floor_bytes == whole.floor_bytes - whole.step_temporaries_bytes
    assert not floors.reaches(rung, made.floor_bytes - 1)  # passed on the made floor, and the note says how
    assert f"{made.describe()}, more than" in floors.note()[0] and f"of its {layers} repeated blocks" in \
        floors.note()[0]


def test_a_figure_off_its_line_makes_no_floor():
    """Three measurements whose weights do not grow by the same bytes a block, or whose blocks add other trained
    sizes, or which differ in what is not a count: nothing is made (the floor is then measured whole)."""
    def at(weights: int, sizes: tuple, name: str = "AdamW") -> StaticMemory:
        return StaticMemory(weights, 10, 20, name, False, trained_sizes=sizes)

    line = [at(100, (1, 5)), at(150, (1, 5, 5)), at(200, (1, 5, 5, 5))]
    made = extrapolated_static(line, 10)
    assert made is not None and made.weights_bytes == 500 and sorted(made.trained_sizes) == [1] + [5] * 9
    scratch = [dataclasses.replace(s, step_temporaries_bytes=t) for s, t in zip(line, (7, 7, 7), strict=True)]
    assert extrapolated_static(scratch, 10).step_temporaries_bytes == 0  # (a peak: left out, never extrapolated)
    assert extrapolated_static([at(100, (1, 5)), at(150, (1, 5, 5)), at(210, (1, 5, 5, 5))], 10) is None
    assert extrapolated_static([at(100, (1, 5)), at(150, (1, 5, 5)), at(200, (1, 5, 5, 6))], 10) is None
    assert extrapolated_static([*line[:2], at(200, (1, 5, 5, 5), "SGD")], 10) is None


def test_a_model_with_too_few_blocks_is_measured_whole(monkeypatch):
    """device: fake. The tiny GPT's 4 layers, under the estimate's 16: every floor is measured on the whole model;
    the fewer-block model is built once to find that out (not again for the next floor), and never where the
    model's own build told the blocks (`knowing`)."""
    from oomtune.search.fewer_blocks import FewerBlocks

    builds = []
    real = FewerBlocks.build
    monkeypatch.setattr(FewerBlocks, "build", lambda self: builds.append(self.keep) or real(self))
    mf = load_model_file(ROOT / "examples" / "tiny_gpt.py")
    static = static_memory(mf)
    floors = RungFloors(mf, static, BlockTrials())
    assert floors.floor(TRUE) == static_memory(mf, floor_plan(TRUE), TRUE.name, checks=False)
    floors.floor(EIGHT_OFFLOAD)
    assert not floors.extrapolated and floors.blocks.blocks == 4 and builds == [2]
    told = RungFloors(mf, static, BlockTrials().knowing(static.repeated_blocks))
    told.floor(TRUE)
    assert builds == [2] and told.blocks.blocks == 4


def test_the_models_own_build_tells_which_blocks_repeat(tmp_path):
    """device: fake. The static memory's build of the whole model finds the repeated blocks a fewer-block model
    would find on a first, untracked build of its own (the estimate then needs none), and a model that repeats
    none says so."""
    from oomtune.search.fewer_blocks import FewerBlocks

    mf = load_model_file(_deeper(tmp_path, MODELS / "hf_llama_lora.py", 6))
    first = FewerBlocks(mf, 2)
    first.build()
    static = static_memory(mf)
    assert static.repeated_blocks == (first.seen.kind, first.seen.length, first.seen.start)
    assert BlockTrials(min_blocks=5).knowing(static.repeated_blocks).blocks == first.repeated == 6
    assert static_memory(load_model_file(MODELS / "hf_convnext.py")).repeated_blocks is None
