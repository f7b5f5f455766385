#!/usr/bin/env bash
# Install whatever is missing, then run the whole test suite (extra arguments go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
source scripts/python_env.sh
export OMP_WAIT_POLICY=PASSIVE
# As an activated environment would: its commands first on PATH.
PATH="$(dirname "$("$PY" -c 'import sys; print(sys.executable)')"):$PATH"
export PATH
"$PY" -m pytest -q "$@"
