"""A Hugging Face BERT classifier with PEFT LoRA as its guides fine-tune one (task_type SEQ_CLS): PEFT keeps a
trained copy of the classifier head (modules_to_save), made with copy.deepcopy. On fake tensors that copied the
fake mode too: the copied head was counted twice, and the process later crashed (exit 139) on the cpu device."""

import torch
from peft import LoraConfig, get_peft_model
from transformers import BertConfig, BertForSequenceClassification

VOCAB, LABELS = 512, 3
DEFAULTS = {"batch": 4, "context": 64}


def build_model():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128, num_labels=LABELS)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], task_type="SEQ_CLS")
    return get_peft_model(BertForSequenceClassification(config), lora)


def make_batch(batch_size, context_length, device):
    ids = torch.randint(1, VOCAB, (batch_size, context_length), device=device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "labels": torch.randint(0, LABELS, (batch_size,), device=device)}
