# Two set-up commands work on a clean clone with only Python 3.10+ present:
#   make demo   creates .venv, installs, probes examples/tiny_gpt.py on the simulated cpu device
#   make test   creates .venv, installs, runs ruff and pytest
# TORCH pins the CPU build this project is developed with; GPU users: `make test TORCH=torch` (or install
# their CUDA build of torch into .venv first: an installed torch>=2.4 is kept).

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.oomtune-installed
DEMO_DIR ?= out/demo

.PHONY: demo test lint bench gpu-check clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	@mkdir -p $(DEMO_DIR)
	$(VENV)/bin/oomtune probe examples/tiny_gpt.py --device cpu --budget 12MiB --out $(DEMO_DIR)/best.yaml
	@echo; echo "--- $(DEMO_DIR)/best.yaml (plan) ---"; sed -n '/^plan:/,/^train:/p' $(DEMO_DIR)/best.yaml | sed '$$d'

lint: $(STAMP)
	$(VENV)/bin/ruff check oomtune tests examples bench

test: lint
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) out .pytest_cache .ruff_cache
