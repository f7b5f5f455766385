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


_STEPS_OF_ACTIVATIONS = """
import resource, torch
from pagedserve.executor.host_memory import keep_freed_memory
assert keep_freed_memory()
faults = []
for step in range(6):  # each 'step' allocates and frees 60 MB of activations, as a long prefill does
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    activations = [torch.ones(5 * 1024**2) for _ in range(3)]
    del activations
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[2:]))
"""


def test_engine_steps_reuse_freed_host_memory():
    """With the engine's malloc settings, later steps reuse the pages earlier steps freed instead of
    page-faulting them back in (glibc's defaults returned them to the OS: ~10k faults a step here)."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _STEPS_OF_ACTIVATIONS], capture_output=True, text=True, check=True)
    pages_touched = 4 * 3 * 5 * 1024**2 * 4 // 4096
    assert int(result.stdout) < pages_touched // 20
