"""The LoRA Llama of hf_llama_qlora.py, its build_model() returning torch.compile(model) (make gpu-check's row for
a model file's own compile: inductor's whole graph on cuda, traced per block and the loss on the fake device)."""

import importlib.util
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location("_hf_llama_qlora", Path(__file__).with_name("hf_llama_qlora.py"))
_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_base)

DEFAULTS = _base.DEFAULTS
make_batch = _base.make_batch


def build_model():
    return torch.compile(_base.build_model())
