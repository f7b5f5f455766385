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



def test_long_prefills_reuse_freed_host_memory(default_llm):
    """With the engine's malloc settings a long prefill reuses the pages the previous one freed: glibc's
    defaults gave them back to the OS and page-faulted 440-730 MB of activations in per 2000-token
    prefill here (all but one of four after the first); with the settings, 0-6 MB after the first."""
    import random
    import resource

    from pagedserve import SamplingParams

    rng = random.Random(0)
    faulted_mb = []
    for _ in range(3):
        prompt = [rng.randrange(100, 40000) for _ in range(2000)]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        default_llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)
        faulted_mb.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * 4096 / 2**20)
    assert sum(faulted_mb[1:]) < 100, faulted_mb
