# The two commands that set everything up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: env demo test test-gpu lint tiny clean

env: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

tiny: env
	$(BIN)/dittrain make-tiny --out models/tiny

# Train a tiny Flux LoRA on the bundled data/ on the CPU, then sample from it.
demo: tiny
	$(BIN)/dittrain fit configs/tiny/flux-lora.yaml
	$(BIN)/dittrain sample configs/tiny/flux-lora.yaml --lora out/tiny-flux-lora/lora.safetensors \
		--prompt "a red square on a blue background" --out out/tiny-flux-lora/samples
	@echo "demo done: LoRA in out/tiny-flux-lora/, images in out/tiny-flux-lora/samples/"

test: env
	$(BIN)/python -m pytest -q -m "not gpu"

# On a machine with a CUDA GPU: exactness tests of the offload conductor.
test-gpu: env
	$(BIN)/python -m pytest -q -m gpu

lint: env
	$(BIN)/ruff check trainer tests bench

clean:
	rm -rf out models/tiny .pytest_cache
