"""A Hugging Face Llama with PEFT AdaLoRA adapters: their ranks are reallocated as it trains (scored from the
gradients after every optimizer step, the least important masked from step tinit to total_step - tfinal), which
only happens where the training loop calls update_and_allocate(step)."""

import peft
import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 256
DEFAULTS = {"batch": 4, "context": 32}
INIT_R, TARGET_R, TOTAL_STEP = 4, 1, 10


def build_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    adalora = peft.AdaLoraConfig(init_r=INIT_R, target_r=TARGET_R, tinit=2, tfinal=2, deltaT=1, total_step=TOTAL_STEP,
                                 target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(LlamaForCausalLM(config), adalora)


def make_batch(batch_size, context_length, device):
    ids = torch.randint(0, VOCAB, (batch_size, context_length), device=device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
