"""litgpt_nf4.py with `--quantize bnb.nf4-dq`: the absmax of each block double-quantized (uint8, an fp32 scale per
256 of them), as Fabric's BitsandbytesPrecision("nf4-dq") stores it; each 4-bit layer's input kept for backward as
bitsandbytes 0.41.1 kept it (see litgpt_nf4.py)."""

import torch
from litgpt_finetune import ARGS, DEFAULTS, loss, make_batch, optimizer  # noqa: F401 - the contract's names
from litgpt_nf4 import build_model  # noqa: F401 - the contract's names
from transformers import BitsAndBytesConfig

bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                         bnb_4bit_compute_dtype=torch.bfloat16, llm_int8_skip_modules=[])
