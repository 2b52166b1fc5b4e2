"""Models a user names without writing the hooks: a Hugging Face folder, config.json or Hub id (hf.py), what a
MODEL argument names and the arguments recorded with it (source.py), LoRA put on any model (lora.py), and the
model-file template `oomtune init` writes (template.py)."""
