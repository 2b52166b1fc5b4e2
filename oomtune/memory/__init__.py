"""Memory: the devices a trial runs on (cuda, and the simulated cpu and fake), the tensor-level tracker behind the
simulated ones, what a peak is made of, the margin and the card table, and NVML."""
