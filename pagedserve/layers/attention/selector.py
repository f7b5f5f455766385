"""Which attention backend an engine runs (the attention_backend setting)."""

from __future__ import annotations

import torch

from pagedserve.layers.attention.backend import AttentionBackend
from pagedserve.layers.attention.cpu_backend import CPUAttentionBackend
from pagedserve.layers.attention.kv_quant import KVFormat
from pagedserve.layers.attention.torch_backend import TorchAttentionBackend


def select_attention_backend(name: str, device: torch.device, dtype: torch.dtype, cpu_kernels,
                             kv_format: KVFormat | None = None, bfloat16_on_tiles: bool = False,
                             bfloat16_gemms: bool = False) -> AttentionBackend:
    """name: auto, cpu or torch. cpu_kernels: the compiled C++ kernels, or None where they are off or
    did not build. kv_format: an 8-bit cache's format, None for a 16- or 32-bit cache. auto takes cpu where it
    applies (CPU, float32 activations, kernels built), else torch. bfloat16_on_tiles: the GEMMs multiply in bfloat16
    on AMX tiles (Worker.bfloat16_on_tiles), so the cpu backend attends fresh prompts in bfloat16 too
    (CPUAttentionBackend). bfloat16_gemms: the GEMMs multiply in bfloat16 (dtype bfloat16, or auto where it resolves
    to it), so the prefill kernel's products may too where the processor has bfloat16 dot products."""
    cpu_applies = device.type == "cpu" and dtype == torch.float32 and cpu_kernels is not None
    if name == "auto":
        name = "cpu" if cpu_applies else "torch"
    if name == "cpu":
        if not cpu_applies:
            raise ValueError(
                "attention_backend 'cpu' needs the C++ CPU kernels (cpu_kernels on, and built), a CPU device and float32; "
                f"got device {device.type}, dtype {str(dtype).removeprefix('torch.')}, kernels "
                f"{'available' if cpu_kernels is not None else 'unavailable'}"
            )
        return CPUAttentionBackend(cpu_kernels, kv_format, fresh_prefill_dtype=torch.bfloat16 if bfloat16_on_tiles else None,
                                   prefill_bf16_products=bfloat16_gemms)
    return TorchAttentionBackend(kv_format)
