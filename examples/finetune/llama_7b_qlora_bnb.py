"""QLoRA as Hugging Face's guides set it up: the 7B Llama of llama_7b.py with PEFT LoRA adapters (r=16 on every
attention and MLP projection) and its frozen base loaded in 4 bits by bitsandbytes (NF4, double-quantized, bf16
compute). oomtune reads the BitsAndBytesConfig below and stores the frozen weights in bitsandbytes' layout on every
rung; build_model() returns the model unquantized, as a from_pretrained(..., quantization_config=bnb) would load
it quantized. Needs transformers, peft and bitsandbytes (pip install 'oomtune[finetune]').

    oomtune estimate examples/finetune/llama_7b_qlora_bnb.py --gpu rtx3060
"""

import torch
from llama_7b import DEFAULTS, VOCAB, llama_7b_config, make_batch  # noqa: F401 - the contract's names
from peft import LoraConfig, get_peft_model
from transformers import BitsAndBytesConfig, LlamaForCausalLM

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                         bnb_4bit_compute_dtype=torch.bfloat16)


def build_model():
    torch.manual_seed(0)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS)
    return get_peft_model(LlamaForCausalLM(llama_7b_config()), lora)
