"""Which attention backend an engine runs (the attention_backend setting)."""

from __future__ import annotations

import torch

from pagedserve.layers.attention.backend import AttentionBackend
from pagedserve.layers.attention.cpu_backend import CPUAttentionBackend
from pagedserve.layers.attention.kv_quant import KVFormat
from pagedserve.layers.attention.torch_backend import TorchAttentionBackend


def select_attention_backend(name: str, device: torch.device, dtype: torch.dtype, cpu_kernels,
                             kv_format: KVFormat | None = None) -> AttentionBackend:
    """name: auto, cpu or torch. cpu_kernels: the compiled C++ kernels, or None where they are off or
    did not build. kv_format: an 8-bit cache's format, None for a 16- or 32-bit cache. auto takes cpu where it
    applies (CPU, float32 activations, kernels built, a 16- or 32-bit cache), else torch."""
    cpu_applies = device.type == "cpu" and dtype == torch.float32 and cpu_kernels is not None and kv_format is None
    if name == "auto":
        name = "cpu" if cpu_applies else "torch"
    if name == "cpu":
        if not cpu_applies:
            raise ValueError(
                "attention_backend 'cpu' needs the C++ CPU kernels (cpu_kernels on, and built), a CPU device, float32 and a "
                f"16- or 32-bit KV cache; got device {device.type}, dtype {str(dtype).removeprefix('torch.')}, kernels "
                f"{'available' if cpu_kernels is not None else 'unavailable'}, kv_cache_dtype "
                f"{kv_format.name if kv_format else 'of 16 or 32 bits'}"
            )
        return CPUAttentionBackend(cpu_kernels)
    return TorchAttentionBackend(kv_format)
