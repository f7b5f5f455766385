"""A Python extension of one C file (pagedserve/csrc), compiled once for this Python and cached; for host code that
must not wait on torch's build tool or import torch (the front end's). The C++ kernels have their own build
(layers/cpu_kernels.py); both import a finished build with `import_library`.

A build is keyed by the source, the flags and the Python it is for, and written under a temporary name first, so that
processes starting together each see either no build or a whole one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from types import ModuleType

from pagedserve.envs import cache_root

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
_FLAGS = ("-O2", "-shared", "-fPIC", "-Wall")


def import_library(name: str, library: Path) -> ModuleType | None:
    """The extension module in library, imported; None if there is no such file or it does not import (a build cut
    short, say)."""
    if not library.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as exc:
        logger.warning("%s did not load (%s); building it again", library, exc)
        return None
    return module


def load(name: str, source: str, what: str) -> ModuleType | None:
    """The module `name` compiled from csrc/<source>, building it first if needed; None, with a warning naming what
    goes without it, when it cannot be built here."""
    try:
        compiler = _compiler()
        library = _library(name, source, compiler)
        module = import_library(name, library)
        if module is None:
            _compile(CSRC / source, library, compiler, what)
            module = import_library(name, library)
        return module
    except (OSError, RuntimeError) as exc:  # no compiler, a failed build, a cache we cannot write
        logger.warning("%s unavailable (%s); using the Python path", what, exc)
        return None


def _compiler() -> list[str]:
    """The C compiler: $CC, else the one this Python was built with when it is here, else cc."""
    for command in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc"):
        if command and shutil.which(shlex.split(command)[0]):
            return shlex.split(command)
    raise RuntimeError("no C compiler found (set CC)")


def _library(name: str, source: str, compiler: list[str]) -> Path:
    digest = hashlib.sha256((CSRC / source).read_bytes())
    digest.update(" ".join((*compiler, *_FLAGS)).encode())
    digest.update(f"{sys.version}|{sysconfig.get_paths()['include']}".encode())
    build_dir = cache_root() / "extensions" / f"{name}-{digest.hexdigest()[:16]}"
    build_dir.mkdir(parents=True, exist_ok=True)
    return build_dir / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"


def _compile(source: Path, library: Path, compiler: list[str], what: str) -> None:
    logger.info("compiling %s (once per machine and Python) into %s", what, library.parent)
    start = time.monotonic()
    partial = library.with_name(f"{library.name}.{os.getpid()}.tmp")
    command = [*compiler, *_FLAGS, f"-I{sysconfig.get_paths()['include']}", str(source), "-o", str(partial)]
    try:
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{shlex.join(command)} failed: {result.stderr.strip()[-2000:]}")
        os.replace(partial, library)
    finally:
        partial.unlink(missing_ok=True)
    logger.info("%s compiled in %.1f s", what, time.monotonic() - start)
