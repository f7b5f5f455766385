"""8-bit KV caches (int8, fp8_e4m3, fp8_e5m2): rows round-trip within their format's bound, an inf or a NaN stays in
its own row, attention over an 8-bit cache stays close to attention over the float32 values it holds, and the engine
keeps its blocks, its other features and most of its greedy agreement with float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import PROMPTS, engine_core_of, greedy, token_ids_of
from test_cpu_kernels import decode_metadata

from pagedserve import LLM
from pagedserve.layers.attention import PrefillChunk
from pagedserve.layers.attention.kv_quant import FORMATS, dequantize_rows, kv_format, quantize_rows
from pagedserve.layers.attention.torch_backend import (
    reference_decode_attention,
    reference_prefill_attention,
    reference_write_kv_cache,
)

# A value's largest error, as a share of its own magnitude (the format's mantissa: half a unit in the last place), and
# as a share of its row's largest (where the format's steps are finest for small values: int8's, fp8's subnormals).
ERROR_BOUNDS = {"int8": (0.0, 0.5 / 127), "fp8_e4m3": (2**-4, 2**-9 / 448), "fp8_e5m2": (2**-3, 2**-16 / 57344 * 4)}


@pytest.mark.parametrize("name", FORMATS)
def test_rows_round_trip_within_the_formats_bound(name):
    fmt = FORMATS[name]
    torch.manual_seed(0)
    rows = torch.randn(64, 4, 64) * torch.logspace(-3, 3, 64)[:, None, None]  # rows of every magnitude
    rows[0, 0] = 0.0
    back = dequantize_rows(quantize_rows(rows, fmt), fmt)
    of_value, of_row = ERROR_BOUNDS[name]
    bound = rows.abs() * of_value + rows.abs().amax(-1, keepdim=True) * of_row * 1.0001
    assert (back - rows).abs().le(bound).all()
    assert back[0, 0].eq(0).all()
    assert quantize_rows(rows, fmt).shape == (64, 4, 64 + 4) and quantize_rows(rows, fmt).dtype == torch.uint8


@pytest.mark.parametrize("name", FORMATS)
def test_an_inf_or_a_nan_stays_in_its_own_row(name):
    fmt = FORMATS[name]
    rows = torch.randn(3, 2, 16)
    rows[1, 0, 3], rows[2, 1, 5] = float("inf"), float("nan")
    back = dequantize_rows(quantize_rows(rows, fmt), fmt)
    healthy = torch.ones(3, 2, dtype=torch.bool)
    healthy[1, 0] = healthy[2, 1] = False
    assert torch.isfinite(back[healthy]).all()
    assert torch.allclose(back[healthy], rows[healthy], atol=0.1 * rows[healthy].abs().max().item())


def test_fp8_is_fp8_e4m3_and_other_names_are_16_or_32_bit():
    assert kv_format("fp8") == FORMATS["fp8_e4m3"]
    assert kv_format("auto") is None and kv_format("bfloat16") is None


def cache_pair(fmt, num_blocks, block_size, num_kv_heads, head_dim, seed=0):
    """An 8-bit cache and the float32 cache of the very values it holds (its rows dequantized)."""
    torch.manual_seed(seed)
    values = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim) * 3
    quantized = quantize_rows(values, fmt)
    return quantized, dequantize_rows(quantized, fmt)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,seq_lens", [
    (9, 3, 64, 16, [1, 17, 40, 100]), (4, 4, 32, 32, [3, 33, 65]), (9, 3, 64, 16, [4096, 7])])
def test_decode_over_an_8_bit_cache_is_attention_over_its_values(name, num_heads, num_kv_heads, head_dim, block_size, seq_lens):
    """The values an 8-bit cache holds are attended exactly as a float32 cache of them would be (GQA and MHA, partial
    blocks, block sizes 16 and 32, contexts up to 4096)."""
    fmt = FORMATS[name]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    quantized, values = cache_pair(fmt, num_blocks, block_size, num_kv_heads, head_dim)
    rng = np.random.default_rng(0)
    order = rng.permutation(num_blocks)
    tables, start = [], 0
    for n in seq_lens:
        tables.append(order[start:start + -(-n // block_size)].astype(np.int64))
        start += len(tables[-1])
    meta = decode_metadata(tables, seq_lens)
    query = torch.randn(len(seq_lens), num_heads, head_dim)
    torch.testing.assert_close(reference_decode_attention(query, quantized, meta, kv_format=fmt),
                               reference_decode_attention(query, values, meta), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", FORMATS)
def test_prefill_after_context_writes_and_reads_the_format(name):
    """A chunk after cached context: its own K/V written in the format, then attended with the context's."""
    fmt = FORMATS[name]
    block_size, num_kv_heads, head_dim, context, chunk_len = 16, 2, 32, 40, 9
    quantized, values = cache_pair(fmt, 8, block_size, num_kv_heads, head_dim, seed=1)
    table = torch.tensor([5, 2, 7, 0], dtype=torch.long)
    slots = torch.tensor([int(table[p // block_size]) * block_size + p % block_size for p in range(context, context + chunk_len)])
    key, value = torch.randn(chunk_len, num_kv_heads, head_dim), torch.randn(chunk_len, num_kv_heads, head_dim)
    reference_write_kv_cache(quantized, key, value, slots, fmt)
    reference_write_kv_cache(values, *(dequantize_rows(quantize_rows(x, fmt), fmt) for x in (key, value)), slots)
    chunk = PrefillChunk(query_start=0, query_len=chunk_len, seq_len=context + chunk_len, block_table=table)
    query = torch.randn(chunk_len, 6, head_dim)
    torch.testing.assert_close(reference_prefill_attention(query, key, value, quantized, chunk, kv_format=fmt),
                               reference_prefill_attention(query, key, value, values, chunk), atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def float32_outputs(default_llm):
    return token_ids_of(default_llm.generate(PROMPTS, greedy(24), use_tqdm=False))


def first_divergence(ours: list[int], theirs: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "fp8_e5m2"])
def test_the_engine_holds_more_blocks_and_keeps_close_to_float32(default_model_dir, float32_outputs, kv_cache_dtype):
    """The same kv_cache_memory holds 3.5x float32's blocks or more; greedy outputs follow float32's for most of their
    tokens (measured 2026-12-02 on the default model, these 4 prompts over 24 tokens: int8 keeps all 4 identical,
    fp8_e4m3 2, fp8_e5m2 1; the thresholds leave one prompt's margin below int8's and sit at the fp8 figures); prefix
    caching, chunked prefill and preemption run on the 8-bit cache."""
    llm = LLM(str(default_model_dir), max_model_len=512, kv_cache_memory=16 * 1024**2, kv_cache_dtype=kv_cache_dtype)
    blocks = engine_core_of(llm).kv_cache_manager.block_pool.num_blocks
    float32_blocks = 16 * 1024**2 // (2 * 30 * 3 * 64 * 4 * 16)  # layers, KV heads, head size, bytes, block size
    assert blocks >= 3.5 * float32_blocks
    outputs = token_ids_of(llm.generate(PROMPTS, greedy(24), use_tqdm=False))
    agreement = [first_divergence(ours, theirs) for ours, theirs in zip(outputs, float32_outputs)]
    assert sum(a == 24 for a in agreement) >= {"int8": 3, "fp8": 2, "fp8_e5m2": 1}[kv_cache_dtype], agreement
    # The cache's features on: a small cache (preemption), small chunks, repeats (prefix hits). Attention then sums in
    # other orders (chunks of other lengths), which can flip a near-tie that 8-bit rounding made: the outputs follow the
    # unchunked ones for most of their length (a block read wrongly would part them at once).
    tight = LLM(str(default_model_dir), max_model_len=128, num_gpu_blocks_override=10, max_num_batched_tokens=16,
                long_prefill_token_threshold=8, kv_cache_dtype=kv_cache_dtype)
    chunked = token_ids_of(tight.generate(PROMPTS * 2, greedy(24), use_tqdm=False))
    assert min(first_divergence(ours, theirs) for ours, theirs in zip(chunked, outputs * 2)) >= 12
    stats = engine_core_of(tight).get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_the_cpu_attention_backend_refuses_an_8_bit_cache_by_name(default_model_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype int8"):
        LLM(str(default_model_dir), kv_cache_memory=16 * 1024**2, kv_cache_dtype="int8", attention_backend="cpu")
