# The two commands that set everything up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: env demo test test-gpu lint tiny clean docs

env: $(STAMP)

# torch's CPU build, first: on Linux, PyPI's wheel of the pinned torch is the CUDA build (it pulls NVIDIA's CUDA
# libraries); PyTorch's CPU index has the same release as <version>+cpu, which pip prefers to the plain one. For a
# GPU, in a fresh clone: `make env TORCH_INDEX=` (PyPI's wheel: the CUDA build on Linux), or PyTorch's index for
# your CUDA version. pip's own configuration (find-links, other indexes) still applies.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH := $(shell sed -n 's/^ *"\(torch==[^"]*\)".*/\1/p' pyproject.toml)
# TORCH_INDEX only where its host resolves: pip retries an index it cannot reach five times, with back-off, for
# torch and for each of its ~10 dependencies (~2 min of waiting measured on a machine without that network, whose
# pip configuration has the CPU wheel; the packages installed are the same without it). Run by the recipe only.
TORCH_INDEX_ARG = $(if $(TORCH_INDEX),$(shell $(PY) -c 'import socket, sys, urllib.parse as u; \
	h = u.urlsplit(sys.argv[1]).hostname; h and socket.getaddrinfo(h, None); print("--extra-index-url", sys.argv[1])' \
	"$(TORCH_INDEX)" 2>/dev/null || echo "TORCH_INDEX $(TORCH_INDEX) does not resolve: pip's own indexes" >&2))

# --no-compile: pip would byte-compile all ~13k .py files of the environment (~70 s of one core measured); Python
# compiles the ~3k modules a run imports on first import instead, once (the .pyc files are written then).
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --no-compile --upgrade pip
	$(BIN)/python -m pip install -q --no-compile "$(TORCH)" $(TORCH_INDEX_ARG)
	$(BIN)/python -m pip install -q --no-compile -e ".[dev]"  # dev: pytest, ruff and wandb (its offline test)
	touch $(STAMP)

tiny: env
	$(BIN)/dittrain make-tiny --out models/tiny

# Train a tiny Flux LoRA on the bundled data/ on the CPU; then sample the same prompts from the untrained and the
# trained model, and draw them side by side (out/demo/demo.png) with the loss curve (out/demo/loss.png).
# --overwrite: every `make demo` is a fresh run in its own out/demo.
DEMO_MODEL := models/tiny/flux-demo
DEMO := configs/tiny/flux-demo.yaml

$(DEMO_MODEL)/model_index.json: trainer/models/demo_model.py | $(STAMP)
	$(BIN)/python -m trainer.demo model $(DEMO_MODEL)

# One torch thread: the tiny model's steps are thread hand-offs more than arithmetic, and with other programs busy
# on the same 2 cores two threads wait on each other (a demo step took 1-8 s with two, 0.15-0.3 s with one, and the
# whole demo 15 min against 1.5-2; 2026-11-27, load average 5-7).
DEMO_RUN := OMP_NUM_THREADS=1 $(BIN)/dittrain

demo: env $(DEMO_MODEL)/model_index.json
	$(DEMO_RUN) fit $(DEMO) --overwrite
	$(DEMO_RUN) sample $(DEMO) --out out/demo/untrained
	$(DEMO_RUN) sample $(DEMO) --lora out/demo/lora.safetensors --out out/demo/trained
	$(BIN)/python -m trainer.demo report $(DEMO)

# One pytest worker per core, each with one torch thread: on 2 cores this is ~3x faster than one process with two
# threads (tiny models are dominated by thread hand-offs), and the pinned golden losses are the same.
# --dist worksteal: each worker starts on one contiguous half of the suite and an idle one takes half of the other's
# queue from its end, so a module's tests stay on one worker (its module-scoped fixtures built once, not once per
# worker, as xdist's default `load` does with its ever smaller chunks) and no worker idles while the other has a queue.
# --durations: every run's log (CI's too) ends with its 30 slowest set-ups and tests, to rank what to speed up.
test: env
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "not gpu" -n auto --dist worksteal --durations=30

# On a machine with a CUDA GPU: exactness tests of the offload conductor.
test-gpu: env
	$(BIN)/python -m pytest -q -m gpu

lint: env
	$(BIN)/ruff check trainer tests bench

clean:
	rm -rf out models/tiny .pytest_cache site

# The guides of docs/ as a static site: site/index.html (MkDocs, mkdocs.yml; --strict there: a broken link between
# guides fails). Needs the docs extra, installed here on first use.
docs: $(STAMP)
	$(BIN)/python -m pip install -q --no-compile -e ".[docs]"
	$(BIN)/python -m mkdocs build
