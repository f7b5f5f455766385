#!/usr/bin/env bash
# Install whatever is missing, then serve the default model (extra arguments go to `pagedserve serve`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/python_env.sh
exec "$PY" -m pagedserve.entrypoints.cli serve "$@"
