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
	$(VENV)/bin/ruff check oomtune tests examples bench scripts

test: lint
	$(PY) -m pytest -q

# The real-GPU truth, on a machine with an NVIDIA GPU (< 8 minutes): the `gpu` tests, then the fake-vs-real memory
# table and the probe's trials and wall time. The machine's own python3 with the checkout on PYTHONPATH: no venv,
# no installs, no network. Exit 0 = all ran and passed, 1 = something failed or did not run, 3 = no CUDA GPU.
# OUT=dir keeps the report (gpu_check.md, gpu_check.json, gpu_tests.txt).
GPU_PYTHON ?= python3
gpu-check:
	PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) scripts/gpu_check.py

clean:
	rm -rf $(VENV) out .pytest_cache .ruff_cache
