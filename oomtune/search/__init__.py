"""The searches: the torch-free ladder, the trial that measures one plan, and probe, estimate and check on top."""
