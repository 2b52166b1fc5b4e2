"""`oomtune train`: the trainer and its parts (run state, checkpoints, recovery, data, logs, signals, launch)."""
