"""8-bit KV caches (kv_cache_dtype int8, fp8_e4m3 or fp8, fp8_e5m2). Each (token, KV head) row of a layer's cache
holds head_dim 8-bit values and then its float32 scale, all in one uint8 tensor [2, blocks, block_size, KV heads,
head_dim + 4]: a block is still one slice of one tensor, so prefix caching, preemption and every rank's cache work
on it as on a 16- or 32-bit one. The scale is the row's largest magnitude over the format's largest value, computed
as the row is written: no calibration, and a row's outliers (an inf, a NaN) stay in that row."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_BYTES = 4  # a float32 after each row's values


@dataclass(frozen=True)
class KVFormat:
    name: str
    storage: torch.dtype  # what the values are, in their bytes
    max_value: float  # the largest magnitude the format holds: a row's largest maps to it
    kernel_code: int  # the C++ kernels' kv_format (csrc/ops.h)

    def row_bytes(self, head_dim: int) -> int:
        return head_dim + SCALE_BYTES


FORMATS = {
    "int8": KVFormat("int8", torch.int8, 127.0, 1),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0, 2),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, 57344.0, 3),
}
ALIASES = {"fp8": "fp8_e4m3"}  # vLLM's name for its default FP8


def kv_format(kv_cache_dtype: str) -> KVFormat | None:
    """The 8-bit format a kv_cache_dtype setting names; None for a 16- or 32-bit cache (or auto)."""
    return FORMATS.get(ALIASES.get(kv_cache_dtype, kv_cache_dtype))


def quantize_rows(rows: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """[..., head_dim] float rows -> [..., head_dim + 4] uint8: each row's values in fmt, then its float32 scale."""
    rows = rows.float()
    scale = rows.abs().amax(dim=-1, keepdim=True) / fmt.max_value
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: any scale reads it back as zeros
    values = rows / scale
    if fmt.storage == torch.int8:
        values = values.round().clamp(-fmt.max_value, fmt.max_value)
    out = torch.empty((*rows.shape[:-1], rows.shape[-1] + SCALE_BYTES), dtype=torch.uint8, device=rows.device)
    out[..., : rows.shape[-1]] = values.to(fmt.storage).view(torch.uint8)
    out[..., rows.shape[-1]:] = scale.view(torch.uint8)
    return out


def dequantize_rows(rows: torch.Tensor, fmt: KVFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """quantize_rows' inverse: [..., head_dim + 4] uint8 -> [..., head_dim] in dtype."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    values = rows[..., :head_dim].view(fmt.storage).float()
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (values * scale).to(dtype)
