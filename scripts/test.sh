#!/usr/bin/env bash
# Install whatever is missing, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_WAIT_POLICY=PASSIVE
python3 -m pytest -q "$@"
