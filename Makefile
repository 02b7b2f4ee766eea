# rematd: `make demo` sets up and runs the demo; `make test` runs every check CI runs.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Empty: scripts/setup.sh picks torch 2.13.0's CPU build unless the machine has an NVIDIA GPU.
TORCH_SPEC ?=

.PHONY: setup demo serve test lint typecheck proto proto-check clean

$(STAMP): pyproject.toml scripts/setup.sh scripts/system-packages.txt scripts/torchvision_cpu.py
	PYTHON=$(PYTHON) VENV=$(VENV) TORCH_SPEC='$(TORCH_SPEC)' bash scripts/setup.sh
	touch $@

setup: $(STAMP)

demo: setup
	$(BIN)/rematd demo

serve: setup
	$(BIN)/rematd serve

proto: setup
	$(BIN)/python scripts/gen_proto.py

proto-check: setup
	$(BIN)/python scripts/gen_proto.py --check

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/python scripts/typecheck.py

test: proto-check lint typecheck
	$(BIN)/python -m pytest -n 2 --dist worksteal -q

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache
