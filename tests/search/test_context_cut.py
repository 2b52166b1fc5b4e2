"""A plan whose accumulation needed a shorter context than micro-batch 1 alone: the rung's own search ran at the
target context, the plan at a cut one. Device: cpu."""

import json

from ..conftest import run_cli

# nanoGPT's shape, small: 4 blocks of 64 wide with 16 heads (the attention's (B, 16, T, T) scores make the context
# dear), a tied head, SDPA
GPT16 = '''
import torch
import torch.nn.functional as F
from torch import nn

LAYERS, HEADS, WIDTH, BLOCK, VOCAB = 4, 16, 64, 256, 256
DEFAULTS = {"batch": 12, "context": 256}

class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.c_proj = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (z.view(B, T, HEADS, C // HEADS).transpose(1, 2) for z in self.c_attn(x).split(WIDTH, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(WIDTH), Attention(), nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH, bias=False), nn.GELU(),
                                 nn.Linear(4 * WIDTH, WIDTH, bias=False))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(BLOCK, WIDTH)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f, self.lm_head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

def build_model():
    torch.manual_seed(0)
    return GPT()

def make_batch(batch_size, context_length, device):
    x = torch.randint(0, VOCAB, (batch_size, context_length), device=device)
    return x, torch.randint(0, VOCAB, (batch_size, context_length), device=device)
'''


def test_a_context_cut_for_accumulation_shows_in_the_ladder_and_the_divisor_note(write_model, tmp_path):
    """In 5.5 MiB micro-batch 1 fits at 256 on the checkpointing rung, 1 x 12 does not: the plan is 1 x 12 at a
    shorter context (240 here), where 2 fits alone and 2 x 6 does not. The ladder table said '256/256 1/12' for that
    rung, and no note said why the micro-batch was 1 (the note looked at the rung's own context only; from a new
    user's pass)."""
    args = ("probe", write_model(GPT16), "--device", "cpu", "--budget", "5.5MiB", "--batch", "12", "--context", "256",
            "--min-context", "32", "--levers", "amp,checkpointing,accumulation", "--out", tmp_path / "best.yaml")
    r = run_cli(*args, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    plan = data["plan"]
    assert (plan["micro_batch_size"], plan["grad_accum_steps"]) == (1, 12) and 32 < plan["context_length"] < 256
    assert data["divisor_note"] == ("micro-batch 2 fits, but 2 x 6 with accumulation does not (accumulation keeps "
                                    "every gradient alive through the next micro-step): it runs as 1 x 12")
    table = run_cli(*args).stdout
    (row,) = [" ".join(line.split()) for line in table.splitlines() if line.strip().startswith("bf16+ckpt ")]
    assert row.startswith(f"bf16+ckpt 256/256 ({plan['context_length']} x12) 1/12"), row
