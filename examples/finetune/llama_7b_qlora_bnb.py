"""QLoRA as Hugging Face's guides set it up: the LoRA Llama of llama_7b_lora.py (r=16 on every attention and MLP
projection) with its frozen base loaded in 4 bits by bitsandbytes (NF4, double-quantized, bf16 compute). oomtune
reads the BitsAndBytesConfig below and stores the frozen weights in bitsandbytes' layout on every rung; build_model()
returns the model unquantized, as a from_pretrained(..., quantization_config=bnb) would load it quantized. Needs
transformers, peft and bitsandbytes (pip install 'oomtune[finetune]').

    oomtune estimate examples/finetune/llama_7b_qlora_bnb.py --gpu rtx3060
"""

import torch
from llama_7b import DEFAULTS, VOCAB, make_batch  # noqa: F401 - the contract's names
from llama_7b_lora import build_model  # noqa: F401 - the contract's names
from transformers import BitsAndBytesConfig

bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                         bnb_4bit_compute_dtype=torch.bfloat16)
