# Sourced by the other scripts: sets PY to the Python that pagedserve is (or will be) installed into.
# An active virtual environment wins; else a .venv made here earlier; else the system's python3, unless
# it refuses pip installs (PEP 668, as on current Debian and Ubuntu), in which case a .venv is made here.
# Asking pip takes seconds, so the answer for the system's python3 is kept in .python-env.
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -n "${VIRTUAL_ENV:-}" ]; then
    PY="$VIRTUAL_ENV/bin/python"
elif [ -x "$_root/.venv/bin/python" ]; then
    PY="$_root/.venv/bin/python"
elif [ -f "$_root/.python-env" ] && [ "$(cat "$_root/.python-env")" = "$(command -v python3)" ]; then
    PY=python3
elif python3 -m pip install --dry-run --quiet --no-deps --disable-pip-version-check pip >/dev/null 2>&1; then
    PY=python3
    command -v python3 > "$_root/.python-env"
else
    echo "python3 refuses pip installs outside a virtual environment: making one in $_root/.venv" >&2
    python3 -m venv "$_root/.venv"
    PY="$_root/.venv/bin/python"
fi
export PY
