"""A Hugging Face Wav2Vec2 CTC model (built from a config, speech frames as input_values, -100 past each label) with
LayerDrop, which the Wav2Vec2 family turns on by default (0.1; 0.5 here, so that a trial whose dice skip no layer is
rare): in training each encoder layer is skipped at random."""

import torch
from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

VOCAB = 32
LAYERDROP = 0.5
DEFAULTS = {"batch": 8, "context": 128}


def build_model():
    torch.manual_seed(0)
    config = Wav2Vec2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=128, conv_dim=(32, 32), conv_kernel=(3, 3), conv_stride=(2, 2),
                            num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, feat_extract_norm="layer",
                            do_stable_layer_norm=True, mask_time_prob=0.0, pad_token_id=0,
                            ctc_loss_reduction="mean", layerdrop=LAYERDROP)
    return Wav2Vec2ForCTC(config)


def make_batch(batch_size, context_length, device):
    labels = torch.randint(1, VOCAB, (batch_size, context_length // 16), device=device)
    labels[:, -2:] = -100
    return {"input_values": torch.randn(batch_size, context_length, device=device), "labels": labels}
