"""Writes tiny-llama/ (a Llama config.json and a word-level tokenizer, no weights) and stories.jsonl, the
Hugging Face folder and data of the README's quickstart. Needs transformers and tokenizers. Run from anywhere:

    python examples/hf/make_tiny_llama.py
"""

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, PreTrainedTokenizerFast

HERE = Path(__file__).resolve().parent
NOUNS = "cat dog bird fox owl frog mouse horse".split()
VERBS = "sat ran slept jumped hid sang ate looked".split()
PLACES = "mat tree house river hill garden barn road".split()
OTHER = "the a on in by near and then . ,".split()


def story(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(3, 6)):
        parts.append(f"the {rng.choice(NOUNS)} {rng.choice(VERBS)} {rng.choice(['on', 'in', 'by', 'near'])} "
                     f"the {rng.choice(PLACES)} .")
    return " ".join(parts)


def main() -> None:
    words = sorted(set(NOUNS + VERBS + PLACES + OTHER))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = HERE / "tiny-llama"
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)
    LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=172, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    rng = random.Random(0)
    (HERE / "stories.jsonl").write_text("".join(json.dumps({"text": story(rng)}) + "\n" for _ in range(300)))


if __name__ == "__main__":
    main()
