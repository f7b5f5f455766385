"""Worker helpers that the engine's correctness rests on."""

import pytest
import torch

from pagedserve.executor.worker import zeroed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kv_cache_memory_starts_zeroed_and_writable(dtype):
    # The reference attention reads whole blocks (masked); NaN garbage in unwritten slots would leak through.
    cache = zeroed((2, 64, 16, 3, 8), dtype, torch.device("cpu"))
    assert cache.shape == (2, 64, 16, 3, 8) and cache.dtype == dtype
    assert not cache.any()
    cache[1, 63].fill_(2.0)
    assert cache.sum().item() == 2.0 * 16 * 3 * 8
