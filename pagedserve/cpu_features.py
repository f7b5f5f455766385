"""What the processor this process runs on can do, read once from the OS: its model, its vector and matrix
instruction sets. Kernel builds are keyed by it, cached measurements of the machine too, and start-up logs the
paths it chose by it."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# Instruction-set extensions pagedserve chooses paths by, as Linux names them in /proc/cpuinfo's flags.
_ISA_FLAGS = ("avx2", "fma", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile",
              "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class CPUFeatures:
    model_name: str
    flags: frozenset[str]

    @property
    def isa(self) -> list[str]:
        """The extensions present, of those pagedserve distinguishes."""
        return [flag for flag in _ISA_FLAGS if flag in self.flags]

    @property
    def has_bfloat16_matrix(self) -> bool:
        """Whether the processor multiplies bfloat16 in hardware (AVX-512 BF16 dot products or AMX tiles), where
        bfloat16 GEMMs run several times the float32 rate rather than converting to float32 first."""
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags

    @property
    def has_int8_matrix(self) -> bool:
        """Whether the processor has int8 dot products (VNNI, or AMX tiles), which oneDNN's int8 GEMMs run on."""
        return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & self.flags)

    @property
    def identity(self) -> str:
        """Model and every flag: what code compiled with -march=native, or a measurement of this machine, depends on."""
        return f"{self.model_name}|{' '.join(sorted(self.flags))}"


@lru_cache(maxsize=1)
def cpu_features() -> CPUFeatures:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux: the model as Python knows it, no flags
        return CPUFeatures(platform.processor() or platform.machine(), frozenset())
    fields = {}
    for line in lines:
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())  # the first processor's (all are alike)
    return CPUFeatures(fields.get("model name", platform.machine()), frozenset(fields.get("flags", "").split()))
