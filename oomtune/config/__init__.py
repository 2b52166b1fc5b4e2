"""The config file: its schema (the plan, the train section, how the plan was found), strict loading, writing
that keeps a person's edits, and the --out checks of probe and estimate."""
