#!/usr/bin/env bash
# Creates the project's virtual environment with everything the demo and tests need.
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

# Debian packages some tests need (promtool, a browser): installed when we can, as root.
packages=$(grep -v '^\s*#' scripts/system-packages.txt | tr -s ' \n' ' ' || true)
if [ -n "${packages// /}" ] && command -v apt-get >/dev/null 2>&1; then
    missing=$(for p in $packages; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
    if [ -n "$missing" ]; then
        if [ "$(id -u)" = 0 ]; then
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing
        else
            echo "setup: missing Debian packages (tests that need them will fail): $missing" >&2
        fi
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
# Torch first and pinned, so the package's own range never pulls a CUDA build on a CPU machine.
"$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
"$VENV/bin/python" -m pip install -q -e '.[dev]'
