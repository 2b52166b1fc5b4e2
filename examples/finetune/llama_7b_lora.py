"""The 7B Llama of llama_7b.py with PEFT LoRA adapters (r=16 on every attention and MLP projection): the base
frozen, the adapters trained, as QLoRA guides set it up. For `oomtune estimate` on the fake device.
Needs transformers and peft (pip install 'oomtune[finetune]').

    oomtune estimate examples/finetune/llama_7b_lora.py --gpu rtx3060
"""

import torch
from llama_7b import DEFAULTS, VOCAB, llama_7b_config, make_batch  # noqa: F401 - the contract's names
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_model():
    torch.manual_seed(0)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS)
    return get_peft_model(LlamaForCausalLM(llama_7b_config()), lora)
