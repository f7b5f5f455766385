#!/usr/bin/env bash
# Install whatever is missing, then run the whole test suite (extra arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/python_env.sh
export OMP_WAIT_POLICY=PASSIVE
"$PY" -m pytest -q "$@"
