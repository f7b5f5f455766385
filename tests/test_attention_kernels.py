"""The CPU decode kernel matches the torch reference backend."""

import numpy as np
import pytest
import torch

from pagedserve.executor.input_batch import _fill_decode_metadata
from pagedserve.layers import cpu_kernels
from pagedserve.layers.attention import AttentionMetadata, reference_decode_attention


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 16), (8, 2, 32)])
def test_cpu_decode_kernel_matches_reference(num_heads, num_kv_heads, head_dim):
    kernels = cpu_kernels.load()
    assert kernels is not None, "the C++ kernel must build on this machine (see scripts/setup.sh)"
    torch.manual_seed(0)
    block_size, num_blocks = 16, 64
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim)
    seq_lens = [1, 17, 40, 16, 100]
    rng = np.random.default_rng(0)
    tables = [rng.permutation(num_blocks)[: -(-n // block_size)].astype(np.int64) for n in seq_lens]
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), num_decode_tokens=len(seq_lens),
                             decode_block_tables=None, decode_seq_lens=None, prefills=[])
    _fill_decode_metadata(meta, tables, seq_lens, block_size, torch.device("cpu"))
    query = torch.randn(len(seq_lens), num_heads, head_dim)
    expected = reference_decode_attention(query, kv_cache, meta)
    actual = kernels.paged_decode_attention(query, kv_cache[0], kv_cache[1], meta.decode_block_tables, meta.decode_seq_lens,
                                            head_dim**-0.5)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)
