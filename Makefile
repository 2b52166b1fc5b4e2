# Two set-up commands work on a clean clone with only Python 3.10+ present:
#   make demo   creates .venv, installs, probes examples/tiny_gpt.py on the simulated cpu device, trains the plan
#   make test   creates .venv, installs, runs ruff and pytest
# TORCH pins the CPU build this project is developed with; GPU users: `make test TORCH=torch` (or install
# their CUDA build of torch into .venv first: an installed torch>=2.4 is kept).

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.oomtune-installed
DEMO_DIR ?= out/demo

.PHONY: demo test lint bench gpu-check clean bench-estimate

# Bytecode is cached inside the venv (.venv/pycache, never in the source tree), even where the environment sets
# PYTHONDONTWRITEBYTECODE: without a cache each process compiles torch's sources anew (import torch + oomtune 12 s
# against 4 s here), and the tests start many (pytest workers, CLI subprocesses, ranks: the rank and signal tests took
# 217 s against 78 s)
unexport PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX ?= $(abspath $(VENV))/pycache

# --no-compile: pip would byte-compile every module of torch, transformers & co. (half the install's time); Python
# compiles the few hundred the tests import on first use and caches them
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --no-compile "$(TORCH)"
	$(PY) -m pip install -q --no-compile -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	@mkdir -p $(DEMO_DIR)
	$(VENV)/bin/oomtune probe examples/tiny_gpt.py --device cpu --budget 12MiB --out $(DEMO_DIR)/best.yaml
	@echo; echo "--- $(DEMO_DIR)/best.yaml (plan) ---"; sed -n '/^plan:/,/^train:/p' $(DEMO_DIR)/best.yaml | sed '$$d'
	@echo; echo "--- oomtune train: that plan, in the same 12 MiB, on the standard library's own sources ---"
	@rm -rf $(DEMO_DIR)/run
	$(VENV)/bin/oomtune train --config $(DEMO_DIR)/best.yaml --run-dir $(DEMO_DIR)/run \
		--steps 12 --lr 0.01 --warmup-steps 2 --log-every-n-steps 2 --eval-interval 12 --eval-steps 4

lint: $(STAMP)
	$(VENV)/bin/ruff check oomtune tests examples bench scripts

# single-threaded torch: on a busy 2-core machine OpenMP's spin-waiting makes two threads ~10x slower than one;
# three pytest workers (pytest-xdist) on two cores, each test file on one of them (module fixtures are built once):
# the multi-rank tests wait on timeouts and rendezvous, and a third worker uses those seconds (working copy: 5:00
# against 6:10 with two; fresh clones: 5:23 and 5:33 with three, 4:59 and 6:11 with four, so no gain from a fourth).
# A fresh clone's `make test` (venv, installs, lint, suite): 5:24, the suite 4:28 of it (2026-12-01)
test: lint
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -n 3 --dist loadfile

# The real-GPU truth, on a machine with an NVIDIA GPU (< 9 minutes): the `gpu` tests, then the fake-vs-real memory
# table and the probe's trials and wall time. The machine's own python3 with the checkout on PYTHONPATH: no venv,
# no installs, no network. Exit 0 = all ran and passed, 1 = something failed or did not run, 3 = no CUDA GPU.
# OUT=dir keeps the report (gpu_check.md, gpu_check.json, gpu_tests.txt).
GPU_PYTHON ?= python3
gpu-check:
	PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} env -u PYTHONPYCACHEPREFIX $(GPU_PYTHON) scripts/gpu_check.py

# oomtune estimate on GPT-2 small (124M, context 1024): the whole ladder on fake tensors, wall time, trial count
# and the breakdown against the design's reference figures -> the estimate section of bench/RESULTS.md; then how
# fast it answers (a bare fake step, GPT-2 small and the three 7B questions, before and after; ~35 min)
bench-estimate: $(STAMP)
	$(PY) -c "import litgpt" 2>/dev/null || $(PY) -m pip install -q --no-compile --no-deps "litgpt==0.5.13"
	$(PY) -m bench.bench_estimate
	$(PY) -m bench.bench_estimate_speed

# the estimate without and with a card's CUDA rules: per rung for the examples and GPT-2 small, and BERT-large's saved
# activations op by op under CPU and CUDA autocast accounting -> the autocast section of bench/RESULTS.md (~1 min)
.PHONY: bench-autocast
bench-autocast: $(STAMP)
	$(PY) -m bench.bench_autocast

# oomtune estimate on a 7B Llama (fake tensors, batch 8, context 2048): full fine-tuning and LoRA on a 24 GB card,
# LoRA on a 12 GB card, with the levers past accumulation -> the levers section of bench/RESULTS.md (~10-15 min)
.PHONY: bench-levers
bench-levers: $(STAMP)
	$(PY) -c "import litgpt" 2>/dev/null || $(PY) -m pip install -q --no-compile --no-deps "litgpt==0.5.13"
	$(PY) -m bench.bench_levers

# the probe from the estimate against the search alone in wall time, tiny_gpt at context 128 (a cpu device trial
# cheaper than a fake trial) and 512 (dearer) -> the prior section of bench/RESULTS.md (~1.5 min)
.PHONY: bench-prior
bench-prior: $(STAMP)
	$(PY) -m bench.bench_prior

# oomtune estimate against peak memory published from real GPUs (torchtune's README tables: Llama2-7B LoRA/QLoRA on
# an RTX 4090, Llama 3.2 3B full/LoRA/QLoRA on an A100-80GB, each recipe modelled with an equivalent Hugging Face
# config; litgpt's resource tables: LoRA/Adapter/QLoRA on Llama 2 7B/13B, one A100 40GB, with litgpt's own code)
# -> the published section of bench/RESULTS.md: figure, kind, ours, error, what is not expressed (~16 min)
# litgpt (its own model code for the litgpt rows) installed without its dependencies: it pins huggingface-hub below
# what transformers needs, and what it imports (lightning, tokenizers, safetensors) is in the dev extra already
.PHONY: bench-published
bench-published: $(STAMP)
	$(PY) -c "import litgpt" 2>/dev/null || $(PY) -m pip install -q --no-compile --no-deps "litgpt==0.5.13"
	$(PY) -m bench.bench_published

# tokens/s of `oomtune train` vs a minimal hand-written loop at the same plan on CPU, median of 3 rounds -> the train
# section of bench/RESULTS.md (with the command that produced it; ~2.5 min)
.PHONY: bench-train
bench-train: $(STAMP)
	$(PY) -m bench.bench_train

# oomtune against Lightning's and Accelerate's batch-size finders and exhaustive truth (3 model files x 3 budgets at
# small batches, plus 2 model files x 3 budgets at target batch 256; simulated cpu device), plus the full ladder under
# both objectives (small batches); runs the other bench-* targets above first (bench/sections.py) and regenerates
# bench/RESULTS.md and bench/results.json (about 37 min on 2 CPU cores)
BENCH_STAMP := $(VENV)/.oomtune-bench-installed
$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -q -e ".[dev,bench]"
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) -m bench.run --out bench/RESULTS.md --json bench/results.json

clean:
	rm -rf $(VENV) out .pytest_cache .ruff_cache
