"""`python -m oomtune ...`: what torchrun starts on every rank (and the same as the `oomtune` command)."""

from oomtune.cli import main

main()
