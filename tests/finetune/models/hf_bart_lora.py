"""A PEFT LoRA BART (encoder-decoder) with a padded batch: its decoder builds its own all-ones attention mask in
float32, which transformers drops for SDPA's causal path when it can read the values."""

import torch
from peft import LoraConfig, TaskType, get_peft_model
from transformers import BartConfig, BartForConditionalGeneration

VOCAB = 256
DEFAULTS = {"batch": 8, "context": 64}


def build_model():
    torch.manual_seed(0)
    config = BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                        max_position_embeddings=128, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                        decoder_start_token_id=2)
    lora = LoraConfig(task_type=TaskType.SEQ_2_SEQ_LM, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return get_peft_model(BartForConditionalGeneration(config), lora)


def make_batch(batch_size, context_length, device):
    ids = torch.randint(3, VOCAB, (batch_size, context_length), device=device)
    mask = torch.ones_like(ids)
    mask[:, -1] = 0  # padded, as real batches are
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.flip(ids, dims=[1])}
