"""The C++ CPU kernels (pagedserve/csrc): compiled once for this machine and cached, and handed to the
layers of an engine that runs them (the cpu_kernels setting).

A build is keyed by everything that determines it: the sources, the compiler flags, the processor
(-march=native), the Python and the torch build it links against (its version, source commit and C++ ABI, not where
it is installed: the library finds torch's own libraries among those `import torch` loaded). Once built, it is
imported as it is, so every checkout and virtual environment of the same sources, Python and torch on the machine
shares one build without running the build tool again. Its sources are copied into the build directory, so that a
build never depends on the checkout it started from. If the compiler or ninja is missing the build fails once, a
warning says why, and every layer runs its plain-torch path.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from pagedserve import c_extension
from pagedserve.cpu_features import cpu_features
from pagedserve.envs import cache_root

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent.parent / "csrc"
_SOURCES = ("paged_attention.cpp", "layer_ops.cpp", "quantized_linear.cpp", "quantized_linear_q8.cpp", "sampling.cpp", "lora.cpp",
            "int8_gemm.cpp", "bf16_gemm.cpp", "tile_blocks.cpp", "fresh_attention.cpp", "decode_layers.cpp", "thread_pinning.cpp",
            "spin_pause.cpp", "int8_peak.cpp", "bindings.cpp")
_HEADERS = ("ops.h", "decode_layers.h", "gguf_block.h", "gguf_sub_blocks.h", "vec_lanes.h", "silu_row.h", "parallel_rows.h",
            "amx_tiles.h", "tile_blocks.h")
_MODULE_NAME = "pagedserve_cpu_kernels"


class UsesCPUKernels:
    """A layer with a C++ kernel for float32 on CPU. `kernels` is the compiled module once its engine
    runs the kernels (attach), else None and the layer runs its plain-torch path."""

    kernels = None

    def kernels_for(self, tensor: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)):
        """The kernels, when set and when they apply to this tensor (on CPU, in one of the dtypes the layer's kernel
        takes); else None."""
        if self.kernels is None or tensor.device.type != "cpu" or tensor.dtype not in dtypes:
            return None
        return self.kernels


def attach(model: nn.Module, kernels) -> None:
    """Hand kernels (or None) to every layer of model that has them."""
    for module in model.modules():
        if isinstance(module, UsesCPUKernels):
            module.kernels = kernels


def _compile_flags() -> list[str]:
    return ["-O3", "-march=native", "-fopenmp", *_vector_flags()]


@lru_cache(maxsize=1)
def load():
    """The compiled module, or None when it cannot be built here."""
    try:
        build_dir = _build_dir()
        # A finished build imports without the build tool (a broken one is built again).
        built = c_extension.import_library(_MODULE_NAME, build_dir / f"{_MODULE_NAME}.so")
        return built if built is not None else _build(build_dir)
    except Exception as exc:  # no compiler, no ninja, ...: the reference paths still work
        logger.warning("CPU kernels unavailable (%s); using the torch reference paths", exc)
        return None


def _build(build_dir: Path):
    # Imported here: torch's build tool takes longer to import than a finished build does.
    from torch.utils.cpp_extension import load as load_extension

    source_dir = build_dir / "src"
    if not all((source_dir / name).is_file() for name in (*_SOURCES, *_HEADERS)):
        staging = build_dir / f"src.tmp{id(build_dir)}"
        staging.mkdir(parents=True, exist_ok=True)
        for name in (*_SOURCES, *_HEADERS):
            shutil.copy(_CSRC / name, staging / name)
        try:
            staging.rename(source_dir)
        except OSError:  # another process copied them first
            shutil.rmtree(staging, ignore_errors=True)
    first_build = not any(build_dir.glob("*.so"))
    if first_build:
        logger.info("compiling the C++ CPU kernels for this machine (once per machine, Python and torch) into %s", build_dir)
    _use_packaged_ninja()
    start = time.monotonic()
    with _progress(build_dir, start) if first_build else contextlib.nullcontext():
        module = load_extension(
            name=_MODULE_NAME,
            sources=[str(source_dir / name) for name in _SOURCES],
            extra_cflags=_compile_flags(),
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    if first_build:
        logger.info("C++ CPU kernels built in %.0f s", time.monotonic() - start)
    return module


def _use_packaged_ninja() -> None:
    """torch runs the `ninja` it finds first on PATH. Put the one pagedserve depends on (the ninja package) first,
    so the same ninja builds whether or not a virtual environment is active: a different ninja reads another's
    build log as stale and rebuilds everything, and a machine without a system ninja still builds."""
    try:
        import ninja
    except ImportError:
        return
    bin_dir = str(ninja.BIN_DIR)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


@contextlib.contextmanager
def _progress(build_dir: Path, start: float, every_s: float = 10.0):
    """Say how far the first build is while it runs (compiled files out of all), every every_s seconds."""
    done = threading.Event()

    def report() -> None:
        while not done.wait(every_s):
            compiled = sum(1 for name in _SOURCES if (build_dir / name.replace(".cpp", ".o")).is_file())
            logger.info("compiling the C++ CPU kernels: %d of %d files compiled, %.0f s", compiled, len(_SOURCES),
                        time.monotonic() - start)

    thread = threading.Thread(target=report, name="kernel-build-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def build_key() -> str:
    """A digest of everything a build depends on: sources, flags, Python, torch, the processor."""
    digest = hashlib.sha256()
    for name in (*_SOURCES, *_HEADERS):
        digest.update(name.encode())
        digest.update((_CSRC / name).read_bytes())
    digest.update(" ".join(_compile_flags()).encode())
    torch_build = f"{torch.__version__}|{torch.version.git_version}|{torch._C._GLIBCXX_USE_CXX11_ABI}"
    digest.update(f"{sys.version}|{torch_build}|{cpu_features().identity}".encode())
    return digest.hexdigest()[:16]


def _build_dir() -> Path:
    build_dir = cache_root() / "extensions" / f"cpu_kernels-{build_key()}"
    build_dir.mkdir(parents=True, exist_ok=True)
    return build_dir


def _vector_flags() -> list[str]:
    # ATen's Vectorized<float> uses AVX2 or AVX-512 intrinsics only when told the CPU has them: 16 lanes where torch's
    # own kernels run 16 (its exp and the like come from the same library).
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX2", "AVX512"):
        return [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    return []


if __name__ == "__main__":  # set-up compiles the kernels ahead of the first start, and times the OpenMP spin's turn
    from pagedserve import log, openmp

    log.configure()
    built = load()
    if built is not None:
        openmp.calibrate_spin(built.spin_pause_seconds)
    sys.exit(0 if built is not None else 1)
