#!/usr/bin/env bash
# Creates the project's virtual environment with everything the demo and tests need.
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
# Torch first and pinned, so the package's own range never pulls a CUDA build on a CPU machine.
"$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
"$VENV/bin/python" -m pip install -q -e '.[dev]'
