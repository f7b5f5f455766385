"""8-bit KV caches (kv_cache_dtype int8, fp8_e4m3 or fp8, fp8_e5m2). Each (token, KV head) row of a layer's cache
holds head_dim 8-bit values and then its float32 scale, all in one uint8 tensor [2, blocks, block_size, KV heads,
head_dim + 4]: a block is still one slice of one tensor, so prefix caching, preemption and every rank's cache work
on it as on a 16- or 32-bit one. The scale is the row's largest magnitude over the format's largest value, computed
as the row is written: no calibration, and a row's outliers (an inf, a NaN) stay in that row. A NaN value is stored as
0 in every format; a row holding an inf reads back as NaNs (its scale is inf)."""

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

    @property
    def takes_static_scales(self) -> bool:
        """Whether a checkpoint's k_scale / v_scale apply: they are calibrated for FP8 (vLLM's convention)."""
        return self.storage != torch.int8


@dataclass(frozen=True)
class StaticKVScales:
    """One layer's per-tensor K and V scales from a checkpoint (a stored value times its scale is the value); None
    where it ships none, and that cache's rows keep scales of their own."""

    key: float | None = None
    value: float | None = None

    def __bool__(self) -> bool:
        return self.key is not None or self.value is not None


NO_STATIC_SCALES = StaticKVScales()


FORMATS = {
    "int8": KVFormat("int8", torch.int8, 127.0, 1),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0, 2),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, 57344.0, 3),
}
ALIASES = {"fp8": "fp8_e4m3"}  # vLLM's name for its default FP8


def kv_format(kv_cache_dtype: str) -> KVFormat | None:
    """The 8-bit format a kv_cache_dtype setting names; None for a 16- or 32-bit cache (or auto)."""
    return FORMATS.get(ALIASES.get(kv_cache_dtype, kv_cache_dtype))


def quantize_rows(rows: torch.Tensor, fmt: KVFormat, static_scale: float | None = None) -> torch.Tensor:
    """[..., head_dim] float rows -> [..., head_dim + 4] uint8: each row's values in fmt, then its float32 scale: the
    static scale where one is given (values beyond the format's range saturate), else the row's own."""
    rows = rows.float()
    if static_scale is not None:
        scale = torch.full((*rows.shape[:-1], 1), static_scale, dtype=torch.float32, device=rows.device)
    else:
        scale = rows.abs().masked_fill(rows.isnan(), 0.0).amax(dim=-1, keepdim=True) / fmt.max_value  # a NaN is passed over
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: any scale reads it back as zeros
    # A NaN is stored as 0: int8 has none, and an fp8 NaN would cost the kernels' every read a compare.
    values = (rows / scale).nan_to_num(nan=0.0).clamp(-fmt.max_value, fmt.max_value)
    if fmt.storage == torch.int8:
        values = values.round()
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
