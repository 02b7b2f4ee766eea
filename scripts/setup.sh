#!/usr/bin/env bash
# Creates the project's virtual environment with everything the demo and tests need.
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
# The CPU build on machines without an NVIDIA GPU: the bare version on PyPI is a multi-GB CUDA build.
# torchvision is pinned to the release built for that torch, so the package's range never moves torch.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
else
    TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0+cpu}
fi
TORCHVISION_SPEC=${TORCHVISION_SPEC:-torchvision==0.28.0}
DEEPSPEED_SPEC=${DEEPSPEED_SPEC:-deepspeed==0.19.8}
TORCHTITAN_SPEC=${TORCHTITAN_SPEC:-torchtitan==0.3.0}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

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
# A local wheel or the configured index first; PyTorch's CPU index when they lack the "+cpu" build.
"$VENV/bin/python" -m pip install -q "$TORCH_SPEC" "$TORCHVISION_SPEC" 2>/dev/null ||
    "$VENV/bin/python" -m pip install -q "$TORCH_SPEC" "$TORCHVISION_SPEC" --extra-index-url "$TORCH_CPU_INDEX"
"$VENV/bin/python" -m pip install -q -e '.[dev]'
# DeepSpeed for its tests (ZeRO on CPU ranks). Its build imports torch, so it builds against the torch pinned above
# (no isolated build env, which would fetch another torch), and without its CUDA ops (DS_BUILD_OPS=0): the CPU ops it
# needs it compiles on first use.
DS_BUILD_OPS=0 "$VENV/bin/python" -m pip install -q --no-build-isolation "$DEEPSPEED_SPEC"

# torchtitan (Python 3.11 or later) for rematd.integrations.torchtitan and its tests. Without its dependencies:
# the dev extra holds those it imports; the rest is wandb, for --metrics.enable-wandb only, and large.
if "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    "$VENV/bin/python" -m pip install -q --no-deps "$TORCHTITAN_SPEC"
fi

# torch and torchvision must load together. On a CPU machine the matching torchvision comes from PyTorch's CPU
# index; where that is out of reach pip takes PyPI's, built for torch's CUDA build, whose compiled ops do not
# load beside the CPU build: `import torchvision` then fails (so do timm, and transformers' models). No CPU
# build of torchvision is on PyPI, as a wheel or as source, so set-up installs scripts/torchvision_cpu.py into
# the environment instead: torchvision's nms as a CPU kernel written in torch, in every Python of it (a .pth
# file; see docs/setup.md). Once installed, it is installed again each time, so that the copy follows the script.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -e "$site/torchvision_cpu.pth" ] || ! "$VENV/bin/python" scripts/torchvision_cpu.py --check; then
    if ! "$VENV/bin/python" scripts/torchvision_cpu.py --install; then
        echo "setup: torchvision does not load beside $("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)')." >&2
        echo "setup: install the torchvision release built for that torch (TORCHVISION_SPEC=...), or uninstall torchvision." >&2
        exit 1
    fi
fi
