"""The C++ CPU kernels match the plain-torch reference paths they replace."""

from functools import partial

import numpy as np
import pytest
import torch

from pagedserve.layers import cpu_kernels
from pagedserve.layers.activation import SiluAndMul
from pagedserve.layers.attention import Attention, AttentionMetadata, BatchLayout, PrefillChunk
from pagedserve.layers.attention.backend import pad_block_tables
from pagedserve.layers.attention.cpu_backend import (
    CPUAttentionBackend,
    PagedPrefills,
    causal_attention_of_run,
    prefill_attention,
    prefill_in_kernel,
)
from pagedserve.layers.attention.torch_backend import (
    TorchAttentionBackend,
    gather_sequence_kv,
    read_kv,
    reference_decode_attention,
    reference_prefill_attention,
)
from pagedserve.layers.layernorm import RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding


def built_kernels():
    kernels = cpu_kernels.load()
    assert kernels is not None, "the C++ kernels must build on this machine (see scripts/setup.sh)"
    return kernels


def with_kernels(module, fn):
    """fn() computed with the module on the C++ kernels, then on its plain-torch path: (kernel, reference)."""
    cpu_kernels.attach(module, built_kernels())
    ours = fn()
    cpu_kernels.attach(module, None)
    return ours, fn()


def decode_metadata(tables, seq_lens) -> AttentionMetadata:
    layout = BatchLayout(np.zeros(0, dtype=np.int64), np.asarray(seq_lens, dtype=np.int64), pad_block_tables(list(tables)), [], [], [])
    return AttentionMetadata.from_layout(layout, torch.device("cpu"))


# What the KV cache may store (kv_cache_dtype); queries and outputs stay float32.
CACHE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size,seq_lens",
    [(9, 3, 64, 16, [1, 17, 40, 16, 100]), (4, 4, 16, 16, [3, 33]), (8, 2, 32, 8, [5] * 12), (6, 2, 24, 16, [700]),
     (9, 3, 64, 32, [2, 64, 65, 300] * 4),
     (9, 3, 64, 16, [1000, 1, 2, 3]),  # one long sequence: the threads' shares are split by context length
     (9, 3, 64, 16, [1500]), (9, 3, 64, 16, [2048, 513, 512]),  # contexts over 512 tokens: attended in parts, merged
     (9, 3, 64, 32, [1100, 7]), (9, 3, 24, 16, [1300, 40]),  # the online-softmax route in parts too
     (4, 2, 64, 16, [7, 50]), (10, 2, 32, 16, [19, 3])],  # query heads per KV head taken 3 at a time: runs of 2, of 3 + 2
)
def test_cpu_decode_kernel_matches_reference(num_heads, num_kv_heads, head_dim, block_size, seq_lens, cache_dtype):
    kernels = built_kernels()
    torch.manual_seed(0)
    num_blocks = max(64, -(-max(seq_lens) // block_size))
    kv_cache = (torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim) * 3).to(cache_dtype)  # sharp softmax: tests the running max
    rng = np.random.default_rng(0)
    tables = [rng.choice(num_blocks, -(-n // block_size), replace=False).astype(np.int64) for n in seq_lens]
    meta = decode_metadata(tables, seq_lens)
    query = torch.randn(len(seq_lens), num_heads, head_dim)
    expected = reference_decode_attention(query, kv_cache, meta)
    actual = kernels.paged_decode_attention(query, kv_cache[0], kv_cache[1], meta.decode_block_tables, meta.decode_seq_lens,
                                            head_dim**-0.5)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)


def test_decode_attention_reads_a_block_table_row_only_as_far_as_its_sequence():
    """The runner leaves past each decode's blocks whatever its row of block tables held before (other requests' block
    ids): the kernel and the reference read each row only as far as its sequence's length, so those ids change nothing."""
    kernels = built_kernels()
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size, seq_lens = 9, 3, 64, 16, [1, 17, 40, 16, 100, 33]
    kv_cache = torch.randn(2, 64, block_size, num_kv_heads, head_dim) * 3
    rng = np.random.default_rng(0)
    tables = [rng.choice(64, -(-n // block_size), replace=False).astype(np.int64) for n in seq_lens]
    padded = decode_metadata(tables, seq_lens)
    stale = decode_metadata(tables, seq_lens)
    past = torch.arange(stale.decode_block_tables.shape[1]) >= torch.tensor([len(t) for t in tables])[:, None]
    stale.decode_block_tables[past] = torch.from_numpy(rng.integers(1, 64, int(past.sum())))
    assert past.any() and not torch.equal(stale.decode_block_tables, padded.decode_block_tables)
    query = torch.randn(len(seq_lens), num_heads, head_dim)
    for meta in (padded, stale):
        torch.testing.assert_close(reference_decode_attention(query, kv_cache, meta), reference_decode_attention(query, kv_cache, padded),
                                   atol=0, rtol=0)
        torch.testing.assert_close(kernels.paged_decode_attention(query, kv_cache[0], kv_cache[1], meta.decode_block_tables,
                                                                  meta.decode_seq_lens, head_dim**-0.5),
                                   kernels.paged_decode_attention(query, kv_cache[0], kv_cache[1], padded.decode_block_tables,
                                                                  padded.decode_seq_lens, head_dim**-0.5), atol=0, rtol=0)


@pytest.mark.parametrize("head_dim", [64, 24])  # the three-pass route and the online-softmax one
def test_cpu_decode_kernel_reads_query_views_as_their_contiguous_copies(head_dim):
    """The query as the qkv GEMM leaves it (each row's heads contiguous, rows qkv wide apart) is read in place, and one
    whose heads are not contiguous is copied first: both give the contiguous query's output, bit for bit."""
    kernels = built_kernels()
    torch.manual_seed(0)
    num_heads, num_kv_heads, block_size, seq_lens = 9, 3, 16, [1, 40, 700, 16]
    kv_cache = torch.randn(2, 64, block_size, num_kv_heads, head_dim) * 3
    rng = np.random.default_rng(2)
    meta = decode_metadata([rng.choice(64, -(-n // block_size), replace=False).astype(np.int64) for n in seq_lens], seq_lens)
    qkv = torch.randn(len(seq_lens), (num_heads + 2 * num_kv_heads) * head_dim)
    row_view = qkv[:, : num_heads * head_dim].view(len(seq_lens), num_heads, head_dim)
    heads_apart = row_view.transpose(0, 1).contiguous().transpose(0, 1)

    def decode(queries):
        return kernels.paged_decode_attention(queries, kv_cache[0], kv_cache[1], meta.decode_block_tables, meta.decode_seq_lens, 0.125)

    expected = decode(row_view.contiguous())
    assert not row_view.is_contiguous() and torch.equal(decode(row_view), expected)
    assert heads_apart.stride(1) != head_dim and torch.equal(decode(heads_apart), expected)


@pytest.mark.parametrize("head_dim", [64, 24])  # the three-pass route and the online-softmax one
def test_cpu_decode_kernel_output_does_not_depend_on_the_batch(head_dim):
    """A long context is attended in parts and merged; where it is cut depends on its own length, so a
    sequence's output is bit-identical alone and beside others (which changes the threads' shares)."""
    kernels = built_kernels()
    torch.manual_seed(0)
    num_blocks, block_size = 200, 16
    kv_cache = torch.randn(2, num_blocks, block_size, 3, head_dim) * 3
    rng = np.random.default_rng(1)
    long_table = rng.choice(num_blocks, 82, replace=False).astype(np.int64)  # 1300 tokens: three parts
    query = torch.randn(3, 9, head_dim)

    def decode(tables, seq_lens, queries):
        meta = decode_metadata(tables, seq_lens)
        return kernels.paged_decode_attention(queries, kv_cache[0], kv_cache[1], meta.decode_block_tables, meta.decode_seq_lens, 0.125)

    alone = decode([long_table], [1300], query[1:2])
    short_tables = [rng.choice(num_blocks, 1, replace=False).astype(np.int64), rng.choice(num_blocks, 3, replace=False).astype(np.int64)]
    batched = decode([short_tables[0], long_table, short_tables[1]], [5, 1300, 40], query)
    assert torch.equal(batched[1], alone[0])


@pytest.mark.parametrize("num_tokens", [1, 32, 700])
def test_rms_norm_kernels_match_reference(num_tokens):
    torch.manual_seed(0)
    norm = RMSNorm(576, eps=1e-5)
    norm.weight.data.uniform_(0.5, 1.5)
    x, residual = torch.randn(num_tokens, 576), torch.randn(num_tokens, 576)
    torch.testing.assert_close(*with_kernels(norm, lambda: norm(x)), atol=1e-5, rtol=1e-5)
    (out, new_residual), (ref_out, ref_residual) = with_kernels(norm, lambda: norm(x, residual))
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_residual, ref_residual)
    head_norm = RMSNorm(64)  # Qwen3's q/k norm: over the last dim of a [T, H, D] view
    q = torch.randn(num_tokens, 3, 128)[:, :, :64]
    torch.testing.assert_close(*with_kernels(head_norm, lambda: head_norm(q)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 32, 700])
def test_rms_norm_between_bfloat16_gemms_is_the_float32_norm_rounded_once(num_tokens):
    """Between bfloat16 GEMMs the norm takes the last one's bfloat16 output beside the float32 residual (widened as it
    is added) and hands the next one bfloat16: the float32 norm of the widened input, rounded once as .to() rounds, bit
    for bit; the residual's sum stays float32. The plain-torch path takes and gives the same dtypes."""
    torch.manual_seed(0)
    norm = RMSNorm(576, eps=1e-5)
    norm.weight.data.uniform_(0.5, 1.5)
    norm.kernels = built_kernels()
    x, residual = torch.randn(num_tokens, 576).bfloat16(), torch.randn(num_tokens, 576)
    out, summed = norm(x, residual, out_dtype=torch.bfloat16)
    wide_out, wide_sum = norm(x.float(), residual)
    assert (out.dtype, summed.dtype) == (torch.bfloat16, torch.float32)
    assert torch.equal(summed, wide_sum) and torch.equal(out, wide_out.bfloat16())
    assert torch.equal(norm(x, residual)[0], wide_out)  # by default the output comes in the residual's dtype
    assert torch.equal(norm(residual, out_dtype=torch.bfloat16), norm(residual).bfloat16())
    norm.kernels = None
    ref_out, ref_sum = norm(x, residual, out_dtype=torch.bfloat16)
    assert (ref_out.dtype, ref_sum.dtype) == (torch.bfloat16, torch.float32)
    torch.testing.assert_close(ref_sum, summed)
    torch.testing.assert_close(ref_out.float(), out.float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("width", [1, 13, 64, 49152])
def test_argmax_kernel_is_torch_argmax(width):
    """Greedy sampling's argmax: the same index as torch.argmax, for ties (the first), -inf, +inf,
    signed zeros and NaN (the first NaN wins, as in torch), in full vectors and in the tail."""
    kernels = built_kernels()
    torch.manual_seed(width)
    rows = torch.randn(10, width)
    rows[1] = float("-inf")
    rows[2, width // 2 :] = rows[2].max() + 1  # a tie from the middle on: the first one
    rows[3, -1] = float("inf")
    rows[4] = 0.0
    rows[4, width // 3] = -0.0
    rows[5, width - 1] = float("nan")
    rows[6, width // 2] = float("nan")
    rows[6, 0] = float("inf")
    rows[7, width // 4] = float("nan")
    rows[7, width - 1] = float("nan")
    rows[8] = float("-inf")
    rows[8, width - 1] = -1e30
    assert torch.equal(kernels.argmax_rows(rows), rows.argmax(dim=-1))
    assert kernels.argmax_rows(rows[:0]).shape == (0,)


@pytest.mark.parametrize("num_tokens", [1, 32, 300])
def test_silu_and_mul_matches_reference(num_tokens):
    torch.manual_seed(0)
    act = SiluAndMul()
    gate_up = torch.randn(num_tokens, 200) * 4
    torch.testing.assert_close(*with_kernels(act, lambda: act(gate_up)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 32, 300])
def test_silu_and_mul_of_bfloat16_is_the_float32_result_rounded_once(num_tokens):
    """A bfloat16 gate-up output (the MLP's, where GEMMs run in bfloat16) stays bfloat16: widened, computed in float32,
    rounded once (within a bfloat16 step: the kernel's exp and reciprocal may differ from torch's in the last float32
    bits), for large and NaN gates too; a width that is not a multiple of the vector's takes the scalar tail."""
    torch.manual_seed(0)
    act = SiluAndMul()
    act.kernels = built_kernels()
    gate_up = (torch.randn(num_tokens, 2 * 75) * 4).bfloat16()
    extremes = torch.tensor([-1000.0, -100.0, -87.5, -20.0, -0.0, 20.0, 100.0, 3e38, float("nan")])
    gate_up[0, : len(extremes)] = extremes  # in the vector loop: the sigmoid's fast forms stay finite and exact enough
    out = act(gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, (torch.nn.functional.silu(gate) * up).bfloat16(), rtol=2**-8, atol=1e-30, equal_nan=True)


@pytest.mark.parametrize("width", [15, 100, 1536])
def test_silu_and_mul_of_float32_into_bfloat16_is_its_float32_result_rounded(width):
    """For a down projection that multiplies its input rounded to bfloat16: a float32 gate-up output's SiLU-and-mul
    written in bfloat16 at once is the float32 result rounded, bit for bit (NaN as NaN), in the vector loop and its
    tail; torch's path (no kernels) rounds the same way; a bfloat16 gate-up cannot be widened by it."""
    torch.manual_seed(0)
    act = SiluAndMul()
    gate_up = torch.randn(300, 2 * width) * 4
    gate_up[0, :9] = torch.tensor([-1000.0, -100.0, -87.5, -20.0, -0.0, 20.0, 100.0, 3e38, float("nan")])
    act.kernels = built_kernels()
    narrow, wide = act(gate_up, out_dtype=torch.bfloat16), act(gate_up)
    assert narrow.dtype == torch.bfloat16 and wide.dtype == torch.float32
    torch.testing.assert_close(narrow, wide.bfloat16(), rtol=0, atol=0, equal_nan=True)
    act.kernels = None
    torch.testing.assert_close(act(gate_up, out_dtype=torch.bfloat16), act(gate_up).bfloat16(), rtol=0, atol=0, equal_nan=True)
    with pytest.raises(RuntimeError, match="out_dtype must be gate_up's dtype, or bfloat16 for a float32 gate_up"):
        built_kernels().silu_and_mul(gate_up.bfloat16(), torch.float32)


@pytest.mark.parametrize("num_tokens", [1, 32, 300])
def test_rotary_kernel_matches_reference(num_tokens):
    torch.manual_seed(0)
    config = type("Config", (), {"rope_theta": 10000.0, "rope_scaling": None})()
    rope = RotaryEmbedding(config, head_dim=64, max_position=4096)
    positions = torch.randint(0, 4096, (num_tokens,))
    qkv = torch.randn(num_tokens, 9 * 64 + 2 * 3 * 64)  # rotated as views into the fused projection
    untouched = qkv[:, 768:].clone()
    original = qkv.clone()

    def rotate():  # the kernel rotates in place: each run starts from the same values
        qkv.copy_(original)
        q, k = rope(positions, qkv[:, :576].reshape(-1, 9, 64), qkv[:, 576:768].reshape(-1, 3, 64))
        return q.clone(), k.clone()

    (q, k), (q_ref, k_ref) = with_kernels(rope, rotate)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(qkv[:, 768:], untouched)


def test_rotary_kernel_rotates_bfloat16_in_float32_and_rounds_once():
    """q and k as a bfloat16 qkv GEMM returns them (views into its output) are rotated in place as their widened
    float32 values are, then rounded once: bit for bit what rotating float32 and rounding after gives."""
    torch.manual_seed(0)
    config = type("Config", (), {"rope_theta": 10000.0, "rope_scaling": None})()
    rope = RotaryEmbedding(config, head_dim=64, max_position=4096)
    rope.kernels = built_kernels()
    positions = torch.randint(0, 4096, (300,))
    qkv = torch.randn(300, 9 * 64 + 2 * 3 * 64).bfloat16()
    wide = qkv.float()
    q_wide, k_wide = rope(positions, wide[:, :576].reshape(-1, 9, 64), wide[:, 576:768].reshape(-1, 3, 64))
    q, k = rope(positions, qkv[:, :576].reshape(-1, 9, 64), qkv[:, 576:768].reshape(-1, 3, 64))
    assert q.dtype == k.dtype == torch.bfloat16
    assert torch.equal(q, q_wide.bfloat16()) and torch.equal(k, k_wide.bfloat16())
    assert torch.equal(qkv[:, :576].reshape(-1, 9, 64), q)  # in place
    assert torch.equal(qkv[:, 768:], wide[:, 768:].bfloat16())  # v untouched


def test_rotary_kernel_rejects_positions_beyond_its_cache():
    kernels = built_kernels()
    cache = torch.zeros(8, 64)
    with pytest.raises(RuntimeError, match="beyond the rotary cache"):
        kernels.rotary_embedding(torch.tensor([8]), torch.zeros(1, 2, 64), torch.zeros(1, 1, 64), cache, cache)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 5, 32), (2, 33, 64), (3, 7, 96), (7, 13, 576), (70, 100, 160), (130, 9, 64)])
def test_quantized_linear_matches_gguf_dequantization(type_name, rows, out_features, in_features):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    kernels = built_kernels()
    qtype = GGMLQuantizationType[type_name]
    rng = np.random.default_rng(rows * out_features)
    blocks = quantize(rng.standard_normal((out_features, in_features)).astype(np.float32), qtype)
    weight = torch.from_numpy(dequantize(blocks, qtype))
    blocks = torch.from_numpy(blocks.copy())
    assert torch.equal(kernels.dequantize_gguf(blocks, int(qtype)), weight)  # bit-identical values
    x, bias = torch.randn(rows, in_features), torch.randn(out_features)
    expected = x.double() @ weight.double().T + bias.double()
    torch.testing.assert_close(kernels.quantized_linear(x, blocks, int(qtype), bias).double(), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kernels.quantized_linear(x, blocks, int(qtype)).double(), expected - bias.double(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows,out_features,in_features", [(3, 8, 32), (7, 24, 96), (16, 48, 576), (70, 16, 160), (130, 40, 64)])
def test_interleaved_quantized_linear_matches_gguf_dequantization(type_name, rows, out_features, in_features):
    """The broadcast GEMM on the interleaved copy: 6-row tiles and their remainders, an odd number of
    8-row groups (a half panel), input chunks of 64 rows, with and without bias."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    kernels = built_kernels()
    qtype = GGMLQuantizationType[type_name]
    rng = np.random.default_rng(rows * out_features)
    blocks = quantize(rng.standard_normal((out_features, in_features)).astype(np.float32), qtype)
    weight = torch.from_numpy(dequantize(blocks, qtype)).double()
    blocks = torch.from_numpy(blocks.copy())
    interleaved = kernels.interleave_gguf_rows(blocks, int(qtype))
    x, bias = torch.randn(rows, in_features), torch.randn(out_features)
    expected = x.double() @ weight.T
    actual = kernels.quantized_linear(x, blocks, int(qtype), bias, interleaved)
    torch.testing.assert_close(actual.double(), expected + bias.double(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kernels.quantized_linear(x, blocks, int(qtype), None, interleaved).double(), expected, rtol=1e-5, atol=1e-4)
    # One accumulator per output, over k in order: a row's result does not depend on its batch.
    assert torch.equal(kernels.quantized_linear(x[-3:].contiguous(), blocks, int(qtype), None, interleaved),
                       kernels.quantized_linear(x, blocks, int(qtype), None, interleaved)[-3:])


def q8_scheme(x: torch.Tensor, raw_blocks: np.ndarray, qtype) -> torch.Tensor:
    """x @ W.T as quantized_linear_q8 defines it, in float64 over gguf's own layout: each 32 values of x rounded to
    nearbyint(x * 127 / max|x|) at scale max|x| / 127, each weight value as d * c + offset (c: the nibble less 8 for Q4,
    offset m + 8d for Q4_1, 0 otherwise; c: the byte for Q8_0), integer products of c and the rounded x, and the
    offset times x's exact sum."""
    from gguf import GGMLQuantizationType

    rows, size = raw_blocks.shape[0], {2: 18, 3: 20, 8: 34}[int(qtype)]
    raw = raw_blocks.reshape(rows, -1, size)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    offset = np.zeros_like(d)
    if qtype == GGMLQuantizationType.Q8_0:
        c = raw[..., 2:].view(np.int8).astype(np.float64)
    else:
        nibbles = raw[..., size - 16:]
        c = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).astype(np.float64) - 8
        if qtype == GGMLQuantizationType.Q4_1:
            offset = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64) + 8 * d
    xb = x.view(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    # 127 / max|x| as one float32 division, as the kernel takes it (a Python number over a tensor is its reciprocal times
    # the number, another float32 that rounds values next to a half the other way), then torch rounds half to even.
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    rounded = torch.round(xb * inverse).double()
    sums = torch.einsum("mbj,nbj->mnb", rounded, torch.from_numpy(c))
    scales = (amax.squeeze(-1) / 127).double()[:, None, :] * torch.from_numpy(d)[None]
    return (sums * scales).sum(-1) + xb.sum(-1).double() @ torch.from_numpy(offset).T


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 5, 32), (2, 33, 64), (3, 7, 96), (5, 13, 576), (9, 40, 160),
                                                            (70, 24, 96), (150, 17, 64), (24, 72, 160), (70, 136, 96)])
def test_q8_quantized_linear_computes_its_scheme(type_name, rows, out_features, in_features):
    """Integer products of x rounded per 32 values, on the blocks' panels: a last group of fewer weight rows than a group
    holds, input rows past a chunk of 64, odd and even block counts, groups split among the threads."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    kernels = built_kernels()
    qtype = GGMLQuantizationType[type_name]
    rng = np.random.default_rng(rows * out_features)
    raw = quantize(rng.standard_normal((out_features, in_features)).astype(np.float32), qtype)
    panels = kernels.pack_q8_panels(torch.from_numpy(raw.copy()), int(qtype))
    # Seeded: with few outputs, an unseeded x now and then gave products near zero, whose relative error passed 3%.
    x = torch.from_numpy(rng.standard_normal((rows, in_features), dtype=np.float32))
    bias = torch.from_numpy(rng.standard_normal(out_features, dtype=np.float32))
    x[0, 32:64] = 0  # a block of zeros rounds to zeros (where there are two)
    expected = q8_scheme(x, raw, qtype)
    actual = kernels.quantized_linear_q8(x, panels, int(qtype), out_features, bias)
    torch.testing.assert_close(actual.double(), expected + bias.double(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kernels.quantized_linear_q8(x, panels, int(qtype), out_features).double(), expected, rtol=1e-5, atol=1e-4)
    # It departs from the float32 product only by the rounding of x: about 0.5% of it.
    exact = x.double() @ torch.from_numpy(dequantize(raw, qtype)).double().T
    assert 0 < (actual.double() - bias.double() - exact).norm() / exact.norm() < 0.03
    # Each output's sum runs over the blocks in one order, whatever rows come with it.
    for row in range(min(rows, 12)):
        alone = kernels.quantized_linear_q8(x[row : row + 1].contiguous(), panels, int(qtype), out_features, bias)
        assert torch.equal(alone, actual[row : row + 1])


def exactly_rounded_input(rows: int, in_features: int, rng: np.random.Generator) -> torch.Tensor:
    """x whose every 32 values round to 8 bits without error: integers in [-127, 127], one of them +-127, times a power of
    two; so the integer products on the panels must give x @ W.T itself."""
    q = rng.integers(-127, 128, (rows, in_features // 32, 32)).astype(np.float32)
    q[..., rng.integers(0, 32)] = 127 * rng.choice([-1, 1], (rows, in_features // 32))
    scales = 2.0 ** rng.integers(-6, 3, (rows, in_features // 32, 1))
    return torch.from_numpy((q * scales).reshape(rows, in_features).astype(np.float32))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 5, 256), (3, 33, 512), (70, 24, 256), (9, 40, 768), (130, 17, 256)])
def test_q8_panels_hold_every_gguf_type_as_gguf_dequantizes_it(type_name, rows, out_features, in_features):
    """Random blocks of each type the panels read (every bit pattern of values, high bits and packed K-quant scales), on
    input that rounds to 8 bits exactly: the integer products equal x @ W.T with W as gguf dequantizes the blocks. On
    random input they are off by the rounding alone, and a row's result does not depend on its batch. The blocks dequantize
    to gguf's values, bit for bit."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from gguf_writer import BLOCK_LAYOUTS, random_blocks

    kernels = built_kernels()
    qtype = int(GGMLQuantizationType[type_name])
    assert kernels.gguf_block_shape(qtype) == BLOCK_LAYOUTS[type_name][:2]
    rng = np.random.default_rng(rows * out_features)
    raw = random_blocks(type_name, out_features, in_features, rng)
    weight = torch.from_numpy(dequantize(raw, GGMLQuantizationType[type_name]))
    assert torch.equal(kernels.dequantize_gguf(torch.from_numpy(raw), qtype), weight)  # bit-identical values
    weight = weight.double()
    panels = kernels.pack_q8_panels(torch.from_numpy(raw), qtype)
    x = exactly_rounded_input(rows, in_features, rng)
    expected = x.double() @ weight.T
    actual = kernels.quantized_linear_q8(x, panels, qtype, out_features).double()
    assert (actual - expected).abs().max() <= 1e-6 * expected.abs().max()
    x = torch.from_numpy(rng.standard_normal((rows, in_features), dtype=np.float32))
    actual = kernels.quantized_linear_q8(x, panels, qtype, out_features)
    exact = x.double() @ weight.T
    assert 0 < (actual.double() - exact).norm() / exact.norm() < 0.03
    for row in range(min(rows, 5)):
        assert torch.equal(kernels.quantized_linear_q8(x[row : row + 1].contiguous(), panels, qtype, out_features), actual[row : row + 1])


def test_q8_parts_of_types_of_their_own_give_each_parts_product_side_by_side():
    """A fused layer whose parts come in different types (q, k in Q4_K and v in Q6_K, as llama.cpp's Q4_K_M files hold
    them): x rounded once, each part's products on its own panels, the bias added to the whole."""
    from gguf import GGMLQuantizationType
    from gguf_writer import random_blocks

    kernels = built_kernels()
    rng = np.random.default_rng(0)
    parts = [("Q4_K", 40), ("Q6_K", 17), ("Q8_0", 9)]
    types = [int(GGMLQuantizationType[name]) for name, _ in parts]
    panels = [kernels.pack_q8_panels(torch.from_numpy(random_blocks(name, rows, 512, rng)), qtype)
              for (name, rows), qtype in zip(parts, types)]
    rows = [rows for _, rows in parts]
    x, bias = torch.randn(7, 512), torch.randn(sum(rows))
    apart = torch.cat([kernels.quantized_linear_q8(x, p, qtype, n) for p, qtype, n in zip(panels, types, rows)], dim=1)
    assert torch.equal(kernels.quantized_linear_q8_parts(x, panels, types, rows), apart)
    assert torch.equal(kernels.quantized_linear_q8_parts(x, panels, types, rows, bias), apart + bias)
    with pytest.raises(RuntimeError, match="one type and one output size for each part"):
        kernels.quantized_linear_q8_parts(x, panels, types[:2], rows)
    with pytest.raises(RuntimeError, match="panels do not hold 33 rows of 512 values"):
        kernels.quantized_linear_q8_parts(x, panels, types, [40, 33, 9])


def test_quantized_linear_names_bad_input():
    kernels = built_kernels()
    blocks = torch.zeros(4, 20, dtype=torch.uint8)  # one Q4_1 block per row: 32 values
    with pytest.raises(RuntimeError, match="unsupported GGUF quantization type"):
        kernels.quantized_linear(torch.zeros(2, 32), blocks, 12)
    with pytest.raises(RuntimeError, match="do not hold 64 values"):
        kernels.quantized_linear(torch.zeros(2, 64), blocks, 3)
    panels = kernels.pack_q8_panels(blocks, 3)
    with pytest.raises(RuntimeError, match="unsupported GGUF quantization type"):
        kernels.quantized_linear_q8(torch.zeros(2, 32), panels, 10, 4)  # Q2_K
    with pytest.raises(RuntimeError, match="panels do not hold 4 rows of 64 values"):
        kernels.quantized_linear_q8(torch.zeros(2, 64), panels, 3, 4)
    # More rows than one group holds (8 or 16, by the build), while the panels hold one group.
    with pytest.raises(RuntimeError, match="panels do not hold 17 rows of 32 values"):
        kernels.quantized_linear_q8(torch.zeros(2, 32), panels, 3, 17)
    with pytest.raises(RuntimeError, match="not whole blocks of 32"):
        kernels.quantized_linear_q8(torch.zeros(2, 40), panels, 3, 4)
    with pytest.raises(RuntimeError, match="unsupported GGUF quantization type"):
        kernels.pack_q8_panels(blocks, 10)
    with pytest.raises(RuntimeError, match="not whole blocks of 144"):
        kernels.pack_q8_panels(blocks, 12)  # Q4_K: 256 values a block
    with pytest.raises(RuntimeError, match="multiple of 8 rows"):
        kernels.interleave_gguf_rows(blocks, 3)
    with pytest.raises(RuntimeError, match="interleaved weight does not match"):
        kernels.quantized_linear(torch.zeros(4, 32), torch.zeros(8, 20, dtype=torch.uint8), 3, None, torch.zeros(10, dtype=torch.uint8))


@pytest.mark.parametrize("tiles", [True, False], ids=["tiles-where-offered", "vectors"])
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 16, 2), (7, 100, 33), (13, 37, 64), (64, 4100, 576), (250, 70, 96),
                                                           (300, 1000, 576)])
def test_bfloat16_products_linear_sums_the_bfloat16_products_in_float32(rows, out_features, in_features, tiles):
    """Vector tiles of 6 rows x 4 blocks of 16 outputs, AMX tiles of 32 rows x 2 blocks (where the processor has them),
    and their remainders, an odd in_features (a half pair), chunks of 240 and 256 rows: x and the weight rounded to
    bfloat16, their products summed in float32, and a row's sums do not depend on its batch."""
    kernels = built_kernels()
    weight, x = torch.randn(out_features, in_features), torch.randn(rows, in_features)
    packed = kernels.pack_bf16_pairs(weight)

    def product(rows_in):
        return kernels.bf16_pairs_linear(rows_in, packed, out_features, None, tiles)

    actual = product(x)
    assert actual.dtype == torch.float32 and actual.shape == (rows, out_features)
    expected = x.bfloat16().double() @ weight.bfloat16().double().T
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-5 * in_features**0.5)
    assert torch.equal(product(x[-3:].contiguous()), actual[-3:])
    assert torch.equal(product(x[:1].contiguous()), actual[:1])
    assert torch.equal(product(x.view(1, rows, in_features)), actual.view(1, rows, out_features))
    # bfloat16 rows (a producer's output rounded there) are the float32 ones rounded, taken as they are where whole pairs
    rounded = x.bfloat16()
    assert torch.equal(product(rounded), product(rounded.float()))
    strided = torch.cat([rounded, rounded[:, :5]], dim=1)[:, :in_features]
    assert torch.equal(product(strided), product(rounded.float()))
    assert_pairs_product_checks(partial(kernels.bf16_pairs_linear, tiles=tiles), x, packed, out_features, actual)


def assert_pairs_product_checks(linear, x, packed, out_features, actual):
    """A product on packed pairs writes into the out given (and returns it), and refuses an out, out_features or
    in_features that is not the weight's."""
    rows, in_features = x.shape
    out = torch.full((rows, out_features), float("nan"))
    assert linear(x, packed, out_features, out).data_ptr() == out.data_ptr() and torch.equal(out, actual)
    with pytest.raises(RuntimeError, match="out must be a contiguous float32 tensor"):
        linear(x, packed, out_features, torch.empty(rows + 1, out_features))
    with pytest.raises(RuntimeError, match="out_features .* must be the packed weight's"):
        linear(x, packed, out_features + 16)
    with pytest.raises(RuntimeError, match="must be the packed weight's in_features"):
        linear(torch.randn(rows, in_features + 32), packed, out_features)


@pytest.mark.parametrize("rows,out_features,in_features", [(1, 16, 2), (7, 100, 33), (9, 37, 64), (64, 4100, 576), (121, 70, 1536),
                                                           (250, 1000, 577)])
def test_float32_products_of_bfloat16_values_are_exact_and_do_not_depend_on_the_batch(rows, out_features, in_features):
    """bf16_weights_linear: float32 x times a weight of bfloat16 values, read from its bfloat16 pairs; tiles of 8 rows x
    3 blocks of 16 outputs and their remainders, chunks of 120 rows, the pairs 128 at a time (the sums stored and taken
    up again), an odd in_features (a half pair). The products are the float32 weight's own (x is not rounded), summed in
    float32, and a row's sums do not depend on its batch."""
    kernels = built_kernels()
    weight, x = torch.randn(out_features, in_features).bfloat16().float(), torch.randn(rows, in_features)
    packed = kernels.pack_bf16_pairs(weight)

    def product(rows_in):
        return kernels.bf16_weights_linear(rows_in, packed, out_features)

    actual = product(x)
    assert actual.dtype == torch.float32 and actual.shape == (rows, out_features)
    torch.testing.assert_close(actual.double(), x.double() @ weight.double().T, rtol=1e-5, atol=1e-5 * in_features**0.5)
    assert torch.equal(product(x[-3:].contiguous()), actual[-3:])
    assert torch.equal(product(x[:1].contiguous()), actual[:1])
    assert torch.equal(product(x.view(1, rows, in_features)), actual.view(1, rows, out_features))
    strided = torch.cat([x, x[:, :5]], dim=1)[:, :in_features]
    assert torch.equal(product(strided), actual)
    assert_pairs_product_checks(kernels.bf16_weights_linear, x, packed, out_features, actual)


def test_float32_products_of_bfloat16_values_read_pairs_only():
    kernels = built_kernels()
    records = kernels.pack_tile_blocks(torch.zeros(16, 18, dtype=torch.uint8), 2)  # Q4_0 blocks repacked for the tiles
    with pytest.raises(RuntimeError, match="packed must come from pack_bf16_pairs"):
        kernels.bf16_weights_linear(torch.zeros(2, 32), records, 16)


@pytest.mark.parametrize("tiles", [True, False], ids=["tiles-where-offered", "vectors"])
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 16, 32), (5, 37, 64), (33, 100, 576), (64, 4100, 576),
                                                           (300, 70, 1536)])
def test_q4_blocks_in_tile_records_give_the_products_of_the_dequantized_weight(type_name, rows, out_features, in_features, tiles):
    """GGUF Q4 blocks repacked for the tiles (pack_tile_blocks) and dequantized as a task goes: the same bits as the
    pairs pack_bf16_pairs makes of gguf's dequantized weight, with outputs past a whole block of 16, panels filled as the
    first group of rows goes and read again by the next, chunks of 240 and 256 rows."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    kernels = built_kernels()
    qtype = GGMLQuantizationType[type_name]
    rng = np.random.default_rng(rows * out_features)
    blocks = quantize(rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.05, qtype)
    weight = torch.from_numpy(dequantize(blocks, qtype))
    records = kernels.pack_tile_blocks(torch.from_numpy(blocks.copy()), int(qtype))
    x = torch.randn(rows, in_features)
    expected = kernels.bf16_pairs_linear(x, kernels.pack_bf16_pairs(weight), out_features, None, tiles)
    assert torch.equal(kernels.bf16_pairs_linear(x, records, out_features, None, tiles), expected)
    assert torch.equal(kernels.bf16_pairs_linear(x[-2:].contiguous(), records, out_features, None, tiles), expected[-2:])


def test_tile_records_take_q4_blocks_only():
    kernels = built_kernels()
    with pytest.raises(RuntimeError, match="tile blocks take GGUF Q4_0 .2. or Q4_1 .3. blocks, not type id 8"):
        kernels.pack_tile_blocks(torch.zeros(16, 34, dtype=torch.uint8), 8)
    records = kernels.pack_tile_blocks(torch.zeros(16, 20, dtype=torch.uint8), 3)
    with pytest.raises(RuntimeError, match="must be the packed weight's in_features"):
        kernels.bf16_pairs_linear(torch.zeros(2, 64), records, 16)
    with pytest.raises(RuntimeError, match="packed must come from pack_bf16_pairs or pack_tile_blocks"):
        kernels.bf16_pairs_linear(torch.zeros(2, 32), records[:, :, :100].contiguous(), 16)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_kv_cache_write_kernel_matches_reference(cache_dtype):
    """The kernel stores what torch's .to(cache dtype) stores (round to nearest even), bit for bit."""
    from pagedserve.layers.attention.torch_backend import reference_write_kv_cache

    kernels = built_kernels()
    torch.manual_seed(0)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 8, 16, 3, 64, 20
    qkv = torch.randn(num_tokens, (9 + 2 * num_kv_heads) * head_dim)  # key/value are strided views, as in the model
    _, key, value = qkv.split([9 * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    key, value = key.view(num_tokens, num_kv_heads, head_dim), value.view(num_tokens, num_kv_heads, head_dim)
    slots = torch.from_numpy(np.random.default_rng(0).choice(num_blocks * block_size, num_tokens, replace=False))
    ours, expected = (torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(cache_dtype) for _ in range(2))
    expected.copy_(ours)
    kernels.write_kv_cache(key, value, ours[0], ours[1], slots)
    reference_write_kv_cache(expected, key, value, slots)
    assert torch.equal(ours, expected)
    if cache_dtype != torch.float32:
        assert not torch.equal(ours[0].view(-1, num_kv_heads, head_dim)[slots].float(), key)  # it did round
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.write_kv_cache(key, value, ours[0], ours[1], slots + num_blocks * block_size)


@pytest.mark.parametrize("kv_format,cache_dtype", [(0, torch.float32), (0, torch.bfloat16), (0, torch.float16), (1, torch.uint8)])
def test_kv_cache_write_kernel_stores_bfloat16_keys_as_their_float32_values(kv_format, cache_dtype):
    """K/V that come in bfloat16 (a bfloat16 qkv GEMM's output) are stored as the same values in float32 would be, in
    every cache format (a bfloat16 cache copies them as they are)."""
    kernels = built_kernels()
    torch.manual_seed(0)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 8, 16, 3, 64, 20
    row = head_dim + (4 if kv_format else 0)  # an 8-bit row carries its scale
    qkv = torch.randn(num_tokens, (9 + 2 * num_kv_heads) * head_dim).bfloat16()
    _, key, value = qkv.split([9 * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    key, value = key.view(num_tokens, num_kv_heads, head_dim), value.view(num_tokens, num_kv_heads, head_dim)
    slots = torch.from_numpy(np.random.default_rng(0).choice(num_blocks * block_size, num_tokens, replace=False))
    narrow, wide = (torch.zeros(2, num_blocks, block_size, num_kv_heads, row, dtype=cache_dtype) for _ in range(2))
    kernels.write_kv_cache(key, value, narrow[0], narrow[1], slots, kv_format)
    kernels.write_kv_cache(key.float(), value.float(), wide[0], wide[1], slots, kv_format)
    assert torch.equal(narrow, wide) and narrow.any()
    with pytest.raises(RuntimeError, match="must both be float32 or both bfloat16"):
        kernels.write_kv_cache(key, value.float(), narrow[0], narrow[1], slots, kv_format)


def chunks_on_random_blocks(chunks, first_row: int, num_blocks: int, block_size: int) -> tuple[list[PrefillChunk], PagedPrefills]:
    """(context, query tokens) chunks one after another from first_row, each on distinct random blocks, and their layout
    as the prefill kernel reads it."""
    rng = np.random.default_rng(0)
    prefills, start = [], first_row
    for context, query_len in chunks:
        table = torch.from_numpy(rng.choice(num_blocks, -(-(context + query_len) // block_size), replace=False).astype(np.int64))
        prefills.append(PrefillChunk(start, query_len, context + query_len, table))
        start += query_len
    return prefills, PagedPrefills.of(prefills, torch.device("cpu"))


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size,chunks",
    [(9, 3, 64, 16, [(1024, 16), (3, 5), (40, 1), (17, 33), (0, 45)]),  # (context, query tokens): prefix hits, odd offsets, a fresh prompt
     (4, 4, 16, 16, [(5, 20)]), (8, 2, 32, 8, [(9, 7), (64, 64)]), (6, 2, 24, 16, [(31, 50)]),
     (9, 3, 64, 32, [(100, 37), (1, 100), (0, 1)]),
     (9, 3, 64, 16, [(600, 200), (2, 2), (3, 3)])],  # one costly chunk: the threads' shares are split by cost
)
def test_cpu_prefill_kernel_matches_reference(num_heads, num_kv_heads, head_dim, block_size, chunks, cache_dtype):
    """Prefill chunks attend causally to their context (if any) and their own tokens, read from the
    blocks; rows of other tokens in the batch are left alone."""
    kernels = built_kernels()
    torch.manual_seed(0)
    num_blocks = 128
    kv_cache = (torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim) * 3).to(cache_dtype)
    num_decodes = 3  # rows before the chunks, as in an engine step
    total = num_decodes + sum(q for _, q in chunks)
    qkv = torch.randn(total, (num_heads + 2 * num_kv_heads) * head_dim)
    query = qkv[:, : num_heads * head_dim].view(total, num_heads, head_dim)  # strided, as the model passes it
    prefills, paged = chunks_on_random_blocks(chunks, num_decodes, num_blocks, block_size)
    out = torch.full((total, num_heads, head_dim), 7.0)
    kernels.paged_prefill_attention(query, kv_cache[0], kv_cache[1], paged.block_tables, paged.query_starts,
                                    paged.query_lens, paged.seq_lens, head_dim**-0.5, out)
    for chunk in prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        positions = torch.arange(chunk.seq_len - chunk.query_len, chunk.seq_len)
        own_slots = chunk.block_table[positions // block_size] * block_size + positions % block_size
        own_keys, own_values = (kv_cache[i].view(-1, num_kv_heads, head_dim)[own_slots].float() for i in (0, 1))  # a fresh chunk's
        expected = reference_prefill_attention(query[rows], own_keys, own_values, kv_cache, chunk)
        torch.testing.assert_close(out[rows], expected, atol=2e-5, rtol=1e-4)
    assert torch.equal(out[:num_decodes], torch.full((num_decodes, num_heads, head_dim), 7.0))


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,context,query_len",
                         [(9, 3, 600, 300), (4, 4, 129, 129), (6, 2, 2000, 150), (8, 2, 40, 400)])
def test_torch_prefill_after_context_matches_reference(num_heads, num_kv_heads, context, query_len, cache_dtype):
    """The chunks left to torch: after context, on CPU the context and the chunk's own keys are attended
    apart and merged; the same as one masked call over both."""
    torch.manual_seed(0)
    block_size, head_dim = 16, 64
    num_blocks = -(-(context + query_len) // block_size)
    kv_cache = (torch.randn(2, num_blocks + 3, block_size, num_kv_heads, head_dim) * 3).to(cache_dtype)
    table = torch.from_numpy(np.random.default_rng(0).choice(num_blocks + 3, num_blocks, replace=False).astype(np.int64))
    chunk = PrefillChunk(0, query_len, context + query_len, table)
    query = torch.randn(query_len, num_heads, head_dim)
    own = torch.zeros(query_len, num_kv_heads, head_dim)  # read from the cache after context, not used
    expected = reference_prefill_attention(query, own, own, kv_cache, chunk)
    torch.testing.assert_close(prefill_attention(query, own, own, kv_cache, chunk), expected, atol=2e-5, rtol=1e-4)


def bfloat16_rounded_attention(query, kv_cache, chunk: PrefillChunk, scale: float, window: int = 0, softcap: float = 0.0):
    """What the prefill kernel's bfloat16 products stand for, over keys that fit one span: q * scale rounded to
    bfloat16, float32 scores and softmax, the probabilities (relative to each row's max) rounded to bfloat16 before
    their product with v, and the sums in float32."""
    keys, values = (kv.float() for kv in gather_sequence_kv(kv_cache, chunk.block_table, chunk.seq_len))  # [S, KV, D]
    group = query.shape[1] // keys.shape[1]
    scores = torch.einsum("qhd,khd->hqk", (query * scale).bfloat16().float(), keys.repeat_interleave(group, dim=1))
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    positions, key_positions = torch.arange(chunk.context_len, chunk.seq_len)[:, None], torch.arange(chunk.seq_len)[None]
    hidden = (key_positions > positions) | ((key_positions <= positions - window) if window else False)
    scores = scores.masked_fill(hidden, float("-inf"))
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    out = torch.einsum("hqk,khd->qhd", weights.bfloat16().float(), values.repeat_interleave(group, dim=1))
    return out / weights.sum(dim=-1).transpose(0, 1)[..., None]


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,chunks,window,softcap",
    [(9, 3, 64, [(1024, 16), (3, 5), (40, 1), (17, 33), (0, 45), (0, 64)], 0, 0.0),  # odd spans, a fresh prompt, context
     (4, 2, 32, [(600, 200), (9, 7)], 0, 0.0), (4, 2, 96, [(70, 90)], 0, 0.0), (2, 1, 128, [(5, 60)], 0, 0.0),
     (9, 3, 64, [(300, 100), (0, 90), (100, 16)], 40, 0.0), (9, 3, 64, [(300, 100), (0, 90), (0, 60)], 0, 5.0)],
)
def test_cpu_prefill_kernel_in_bfloat16_pairs_rounds_only_q_and_the_probabilities(num_heads, num_kv_heads, head_dim, chunks, window,
                                                                                  softcap):
    """Over a bfloat16 cache with bf16_products, the prefill kernel multiplies q and the probabilities rounded to
    bfloat16: a chunk whose keys fit one span of the kernel (64) gives what that rounding gives, a longer one stays
    within bfloat16's precision of float32 attention; rows of other tokens are left alone. Where the build has no
    AVX-512 BF16 it says so and refuses."""
    kernels = built_kernels()
    torch.manual_seed(0)
    block_size, num_blocks, scale = 16, 256, head_dim**-0.5
    kv_cache = (torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim) * 3).bfloat16()
    num_decodes = 3
    total = num_decodes + sum(q for _, q in chunks)
    query = torch.randn(total, num_heads, head_dim)
    prefills, paged = chunks_on_random_blocks(chunks, num_decodes, num_blocks, block_size)
    out = torch.full((total, num_heads, head_dim), 7.0)
    args = (query, kv_cache[0], kv_cache[1], paged.block_tables, paged.query_starts, paged.query_lens, paged.seq_lens, scale, out, 0,
            window, softcap)
    if not kernels.prefill_bf16_products():
        with pytest.raises(RuntimeError, match="AVX-512 BF16"):
            kernels.paged_prefill_attention(*args, bf16_products=True)
        return
    kernels.paged_prefill_attention(*args, bf16_products=True)
    for chunk in prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        first_key = max(0, chunk.context_len - window + 1) if window else 0
        if chunk.seq_len - first_key <= 64:  # one span: the rounding alone departs from float32
            expected = bfloat16_rounded_attention(query[rows], kv_cache, chunk, scale, window, softcap)
            torch.testing.assert_close(out[rows], expected, atol=2e-5, rtol=1e-4)
        own_keys, own_values = (read_kv(kv, None, torch.float32) for kv in gather_sequence_kv(kv_cache, chunk.block_table,
                                                                                                chunk.seq_len))
        exact = reference_prefill_attention(query[rows], own_keys[chunk.context_len:], own_values[chunk.context_len:], kv_cache,
                                            chunk, scale, window=window or None, softcap=softcap or None)
        torch.testing.assert_close(out[rows], exact, atol=0.1, rtol=0.02)  # bfloat16's 8 bits, on values of magnitude ~3
    assert torch.equal(out[:num_decodes], torch.full((num_decodes, num_heads, head_dim), 7.0))


def test_cpu_prefill_kernel_names_a_chunk_outside_its_table():
    kernels = built_kernels()
    kv_cache = torch.zeros(2, 4, 16, 1, 8)
    query, out = torch.zeros(40, 1, 8), torch.zeros(40, 1, 8)
    one = torch.ones(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="chunk 0"):  # 40 tokens need 3 blocks, the table has 1
        kernels.paged_prefill_attention(query, kv_cache[0], kv_cache[1], torch.zeros(1, 1, dtype=torch.long), one * 0,
                                        one * 10, one * 40, 1.0, out)


def mixed_step_layout(seqs: list[tuple[int, int]], num_decodes: int, blocks, block_size: int) -> BatchLayout:
    """A step of the sequences (context, query tokens), the first num_decodes of them decodes, each taking its blocks
    from the iterator blocks in turn."""
    tables, slots = [], []
    for context, query_len in seqs:
        table = np.array([next(blocks) for _ in range(-(-(context + query_len) // block_size))], dtype=np.int64)
        positions = np.arange(context, context + query_len)
        slots.extend(table[positions // block_size] * block_size + positions % block_size)
        tables.append(table)
    decodes, chunks = seqs[:num_decodes], seqs[num_decodes:]
    return BatchLayout(np.array(slots), np.array([c + q for c, q in decodes]), pad_block_tables(tables[:num_decodes]),
                       [q for _, q in chunks], [c + q for c, q in chunks], tables[num_decodes:])


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_cpu_backend_routes_every_chunk_once(cache_dtype, lanes):
    """One step with decodes, short and long fresh prompts, short and long chunks after context: the layer on
    the CPU backend gives what it gives on the torch reference backend for every row (no chunk skipped or
    done twice), routed as kernels of 8 lanes route them (the long chunks to torch) and of 16 (all to the kernel)."""
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 320
    rng = np.random.default_rng(0)
    # (context, query tokens): decodes, then fresh short and long, after context short, long on a short and on a long context
    seqs = [(4, 1), (39, 1), (0, 30), (0, 600), (300, 16), (20, 200), (400, 150)]
    layout = mixed_step_layout(seqs, 2, iter(rng.permutation(num_blocks)), block_size)
    num_tokens = len(layout.slot_mapping)
    query = torch.randn(num_tokens, num_heads, head_dim)
    # K/V the cache dtype holds exactly: the kernels read a fresh chunk's K/V back from the cache, torch takes them as given
    key, value = torch.randn(2, num_tokens, num_kv_heads, head_dim).to(cache_dtype).float()
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(cache_dtype)
    cpu = CPUAttentionBackend(built_kernels())
    cpu.prefill_lanes = lanes
    outputs = []
    for backend in (cpu, TorchAttentionBackend()):
        meta = backend.build_metadata(layout, torch.device("cpu"))
        layer = Attention(num_heads, head_dim, num_kv_heads, backend)
        outputs.append(layer(query, key, value, cache.clone(), meta))
    cpu_meta = cpu.build_metadata(layout, torch.device("cpu"))
    assert cpu_meta.paged_prefills is not None and len(cpu_meta.torch_chunks) == {8: 2, 16: 0}[lanes]
    torch.testing.assert_close(outputs[0], outputs[1], atol=2e-5, rtol=1e-4)


def test_fresh_prompts_attended_in_bfloat16_in_runs_of_one_length():
    """Where GEMMs multiply in bfloat16 on AMX tiles, chunks that start their sequences are attended by torch in
    bfloat16, side-by-side chunks of one length in one call: each row as the float32 reference gives it, within
    bfloat16's rounding of queries, keys and values; decodes and chunks after context as before, and the selector
    takes it exactly where told the GEMMs run in bfloat16 on the tiles."""
    from pagedserve.layers.attention import select_attention_backend
    from pagedserve.layers.attention.cpu_backend import FreshRun

    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 64
    seqs = [(7, 1), (0, 40), (0, 40), (0, 40), (0, 30), (50, 20), (0, 30)]  # (context, query tokens)
    layout = mixed_step_layout(seqs, 1, iter(range(num_blocks)), block_size)
    num_tokens = len(layout.slot_mapping)
    query = torch.randn(num_tokens, num_heads, head_dim)
    key, value = torch.randn(2, num_tokens, num_kv_heads, head_dim).bfloat16().float()
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).bfloat16()
    kernels = built_kernels()
    bf16 = CPUAttentionBackend(kernels, fresh_prefill_dtype=torch.bfloat16)
    meta = bf16.build_metadata(layout, torch.device("cpu"))
    assert meta.fresh_runs == [FreshRun(1, 40, 3), FreshRun(121, 30, 1), FreshRun(171, 30, 1)]
    assert meta.paged_prefills is not None and meta.paged_prefills.query_starts.tolist() == [151]
    outputs = [Attention(num_heads, head_dim, num_kv_heads, backend)(query, key, value, cache.clone(),
                                                                      backend.build_metadata(layout, torch.device("cpu")))
               for backend in (bf16, TorchAttentionBackend())]
    fresh_rows = torch.zeros(num_tokens, dtype=torch.bool)
    for run in meta.fresh_runs:
        fresh_rows[run.query_start : run.query_start + run.query_len * run.count] = True
    torch.testing.assert_close(outputs[0][fresh_rows], outputs[1][fresh_rows], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outputs[0][~fresh_rows], outputs[1][~fresh_rows], atol=2e-5, rtol=1e-4)
    chosen = select_attention_backend("cpu", torch.device("cpu"), torch.float32, kernels, bfloat16_on_tiles=True)
    assert chosen.fresh_prefill_dtype == torch.bfloat16
    assert select_attention_backend("cpu", torch.device("cpu"), torch.float32, kernels).fresh_prefill_dtype is None


def test_bfloat16_queries_keys_and_values_give_the_float32_output_rounded():
    """Where fresh prompts are attended in bfloat16, the backend also takes query, key and value in bfloat16 (a bfloat16
    qkv GEMM's output as it comes) and returns bfloat16: in a step with decodes, fresh prompts and a chunk after
    context, each row is what the same values in float32 give, rounded, and the cache holds the same K/V."""
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 64
    seqs = [(7, 1), (19, 1), (0, 40), (0, 40), (50, 20), (0, 30)]  # (context, query tokens)
    layout = mixed_step_layout(seqs, 2, iter(range(num_blocks)), block_size)
    num_tokens = len(layout.slot_mapping)
    query = torch.randn(num_tokens, num_heads, head_dim).bfloat16()
    key, value = torch.randn(2, num_tokens, num_kv_heads, head_dim).bfloat16()
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).bfloat16()
    backend = CPUAttentionBackend(built_kernels(), fresh_prefill_dtype=torch.bfloat16)
    assert backend.takes_bfloat16 and not CPUAttentionBackend(built_kernels()).takes_bfloat16
    layer = Attention(num_heads, head_dim, num_kv_heads, backend)
    narrow_cache, wide_cache = cache.clone(), cache.clone()
    narrow = layer(query, key, value, narrow_cache, backend.build_metadata(layout, torch.device("cpu")))
    wide = layer(query.float(), key.float(), value.float(), wide_cache, backend.build_metadata(layout, torch.device("cpu")))
    assert narrow.dtype == torch.bfloat16 and wide.dtype == torch.float32
    assert torch.equal(narrow, wide.bfloat16()) and torch.equal(narrow_cache, wide_cache)
    decodes = mixed_step_layout(seqs[:2], 2, iter(range(num_blocks)), block_size)  # a step of decodes alone
    alone = layer(query[:2], key[:2], value[:2], cache.clone(), backend.build_metadata(decodes, torch.device("cpu")))
    assert alone.dtype == torch.bfloat16 and torch.equal(alone, narrow[:2])


@pytest.mark.parametrize("fresh_in_bfloat16", [True, False], ids=["fresh-on-tiles-where-offered", "fresh-in-float32"])
def test_the_output_comes_in_the_dtype_the_output_projection_multiplies(fresh_in_bfloat16):
    """out_dtype bfloat16 (an output projection that multiplies its input rounded to it): from float32 query, key and
    value, each backend gives its own float32 output rounded once, in a step with decodes, fresh prompts and a chunk
    after context and in a step of decodes alone."""
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 64
    seqs = [(7, 1), (19, 1), (0, 40), (0, 40), (50, 20), (0, 30)]  # (context, query tokens)
    num_tokens = 2 + 40 + 40 + 20 + 30
    query = torch.randn(num_tokens, num_heads, head_dim)
    key, value = torch.randn(2, num_tokens, num_kv_heads, head_dim)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).bfloat16()
    fresh_dtype = torch.bfloat16 if fresh_in_bfloat16 else None
    for backend in (CPUAttentionBackend(built_kernels(), fresh_prefill_dtype=fresh_dtype), TorchAttentionBackend()):
        layer = Attention(num_heads, head_dim, num_kv_heads, backend)
        for step in (seqs, seqs[:2]):
            layout = mixed_step_layout(step, 2, iter(range(num_blocks)), block_size)
            rows = len(layout.slot_mapping)
            outputs = [layer(query[:rows], key[:rows], value[:rows], cache.clone(), backend.build_metadata(layout, torch.device("cpu")),
                             out_dtype=out_dtype) for out_dtype in (None, torch.bfloat16)]
            assert outputs[0].dtype == torch.float32 and outputs[1].dtype == torch.bfloat16
            assert torch.equal(outputs[1], outputs[0].bfloat16())


def fresh_qkv(count: int, length: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0):
    """q, k and v of count sequences side by side, as views of one bfloat16 qkv GEMM output (rows of all three)."""
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(count * length, (heads + 2 * kv_heads) * head_dim, generator=generator).bfloat16()
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim), v.view(-1, kv_heads, head_dim)


@pytest.mark.parametrize("count,length,heads,kv_heads,head_dim", [
    (16, 128, 9, 3, 64), (3, 37, 4, 2, 128), (1, 300, 2, 1, 32), (2, 1, 2, 2, 64), (1, 97, 6, 6, 96)])
def test_fresh_prompts_on_amx_tiles_are_attended_as_torchs_bfloat16_flash_kernel_attends_them(count, length, heads, kv_heads,
                                                                                              head_dim):
    """Where the AMX tiles are granted, fresh prompts side by side are attended on them: each row within bfloat16's
    rounding of the float32 attention of the same values, as close to it as torch's bfloat16 flash kernel is; a
    sequence's rows are the same bits alone as beside others. Elsewhere the kernel refuses, naming the check."""
    kernels = built_kernels()
    q, k, v = fresh_qkv(count, length, heads, kv_heads, head_dim)
    scale = head_dim ** -0.5
    if not kernels.fresh_attention_on_tiles(head_dim):
        assert not kernels.bf16_matrix_tiles() or head_dim % 32
        with pytest.raises(RuntimeError, match="fresh_attention_on_tiles"):
            kernels.fresh_causal_attention(q, k, v, count, scale)
        return
    ours = kernels.fresh_causal_attention(q, k, v, count, scale)
    assert ours.dtype == torch.bfloat16 and ours.shape == q.shape
    exact = causal_attention_of_run(q.float(), k.float(), v.float(), count, scale, torch.float32)
    torchs = causal_attention_of_run(q, k, v, count, scale, torch.bfloat16)
    torch_error = (torchs.float() - exact).abs().max().item()
    assert (ours.float() - exact).abs().max().item() <= max(1.5 * torch_error, 1e-2)
    last = slice((count - 1) * length, count * length)
    alone = kernels.fresh_causal_attention(q[last], k[last], v[last], 1, scale)
    assert torch.equal(alone, ours[last])


def test_fresh_prompts_on_amx_tiles_refuse_what_they_do_not_take():
    """Inputs the kernel does not take get an error naming what it takes (on a machine without the tiles, every call
    does: the tiles are what it names)."""
    kernels = built_kernels()
    q, k, v = fresh_qkv(2, 16, 4, 2, 64)
    if not kernels.fresh_attention_on_tiles(64):
        with pytest.raises(RuntimeError, match="runs on AMX tiles"):
            kernels.fresh_causal_attention(q, k, v, 2, 0.125)
        return
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.fresh_causal_attention(q.float(), k.float(), v.float(), 2, 0.125)
    with pytest.raises(RuntimeError, match="count"):
        kernels.fresh_causal_attention(q, k, v, 3, 0.125)
    with pytest.raises(RuntimeError, match="multiple of key and value heads"):
        kernels.fresh_causal_attention(q, *fresh_qkv(2, 16, 4, 3, 64)[1:], 2, 0.125)
    assert not kernels.fresh_attention_on_tiles(48) and kernels.fresh_attention_on_tiles(256)


def test_the_backend_routes_as_its_kernels_are_built():
    """16-lane kernels (AVX-512) take every chunk; 8-lane ones leave long fresh prompts and long chunks on longer
    contexts to torch."""
    kernels = built_kernels()
    assert CPUAttentionBackend(kernels).prefill_lanes == kernels.prefill_lanes() in (8, 16)
    table = torch.arange(400)
    long_fresh, long_after = PrefillChunk(0, 2048, 2048, table), PrefillChunk(0, 1024, 5120, table)
    short_after, long_on_short = PrefillChunk(0, 128, 4096, table), PrefillChunk(0, 600, 700, table)
    assert [prefill_in_kernel(c, 8) for c in (long_fresh, long_after, short_after, long_on_short)] == [False, False, True, True]
    assert all(prefill_in_kernel(c, 16) for c in (long_fresh, long_after, short_after, long_on_short))


def test_the_processor_features_read_agree_with_what_torch_detects():
    from pagedserve.cpu_features import cpu_features

    features = cpu_features()
    assert features.model_name and set(features.isa) <= features.flags
    assert ("avx2" in features.isa) == (torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))
    assert features.model_name in features.identity


_PINNED_THREADS = """
import glob, json, os
import torch
from pagedserve.layers import cpu_kernels

def allowed(task):
    return sorted(os.sched_getaffinity(int(os.path.basename(task))))

cpus = sorted(os.sched_getaffinity(0))[:2]
kernels = cpu_kernels.load()
x = torch.randn(64, 4096)
before = torch.nn.functional.silu(x)
def threads():
    tasks = {int(os.path.basename(t)): allowed(t) for t in glob.glob("/proc/self/task/*")}
    return {"main": tasks[os.getpid()], "others": [v for k, v in tasks.items() if k != os.getpid()]}

kernels.set_thread_cpus([[cpu] for cpu in cpus])
after = torch.nn.functional.silu(x)  # a parallel region on the pinned threads
pinned = threads()
kernels.set_thread_cpus([cpus] * len(cpus))
freed = threads()
try:
    kernels.set_thread_cpus([[-1]])
    refused = ""
except RuntimeError as error:
    refused = str(error)
print(json.dumps({"cpus": cpus, "threads": torch.get_num_threads(), "pinned": pinned, "freed": freed,
                  "same": bool(torch.equal(before, after)), "refused": refused}))
"""


def test_each_torch_thread_runs_on_the_cpus_it_is_given():
    """In a process of its own (pinning the test process would bind every process the suite starts after it)."""
    import json
    import subprocess
    import sys

    built_kernels()
    result = subprocess.run([sys.executable, "-c", _PINNED_THREADS], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    cpus = report["cpus"]
    assert report["threads"] == len(cpus) and report["same"]
    pinned, freed = report["pinned"], report["freed"]
    assert pinned["main"] == cpus[:1]  # the calling thread is OpenMP's thread 0
    # Each other CPU holds exactly one thread pinned to it alone; threads outside OpenMP's team keep every CPU.
    assert sorted(cpu for allowed in pinned["others"] if len(allowed) == 1 for cpu in allowed) == cpus[1:]
    # Freed, each thread runs on every CPU given again.
    assert freed["main"] == cpus and not any(len(allowed) == 1 for allowed in freed["others"] if len(cpus) > 1)
    assert "-1" in report["refused"]


@pytest.fixture
def kernels_loaded_anew():
    """cpu_kernels.load() forgets the module it loaded, before and after the test."""
    cpu_kernels.load.cache_clear()
    yield
    cpu_kernels.load.cache_clear()


def _build_tool_must_not_run(**kwargs):
    raise AssertionError("the kernels were built again")


def test_a_finished_build_is_used_without_building_again(monkeypatch, kernels_loaded_anew):
    """Another checkout or virtual environment with the same sources, Python and torch imports the build as it is."""
    import torch.utils.cpp_extension

    assert cpu_kernels.load() is not None  # built (or found) as usual
    cpu_kernels.load.cache_clear()
    monkeypatch.setattr(torch.utils.cpp_extension, "load", _build_tool_must_not_run)
    module = cpu_kernels.load()
    assert module is not None and callable(module.paged_decode_attention)


def test_a_spin_turn_is_timed_and_kept_for_later_starts(tmp_path, monkeypatch):
    """The kernels time an x86 pause (the turn of libgomp's spin); the first measurement on a processor is kept, and
    the spin count later starts set comes from it."""
    from pagedserve import openmp

    seconds = built_kernels().spin_pause_seconds()
    assert 1e-10 < seconds < 1e-5
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    assert openmp.spin_count() == openmp.UNCALIBRATED_SPIN_COUNT
    openmp.calibrate_spin(lambda: seconds)
    openmp.calibrate_spin(lambda: 1.0)  # measured once: a later measurement does not replace it
    assert openmp.spin_count() == round(openmp.SPIN_SECONDS / seconds)


def test_a_build_that_does_not_load_is_built_again(monkeypatch, tmp_path, caplog, kernels_loaded_anew):
    import torch.utils.cpp_extension

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    (cpu_kernels._build_dir() / "pagedserve_cpu_kernels.so").write_bytes(b"a link cut short")
    rebuilt = object()
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kwargs: rebuilt)
    assert cpu_kernels.load() is rebuilt
    assert "did not load" in caplog.text and str(tmp_path) in caplog.text


def brute_force_attention(query, keys, values, query_positions, window: int | None, scale: float,
                          softcap: float | None = None) -> torch.Tensor:
    """Each query row [H, D] at its position over the keys/values [L, KV, D] at positions (p - window, p] (window None:
    [0, p]), each scaled score s taken as softcap * tanh(s / softcap) where softcap is set, by the softmax written out:
    an oracle independent of the reference paths' masks."""
    group = query.shape[1] // keys.shape[1]
    out = torch.empty_like(query)
    for row, position in enumerate(query_positions):
        lo = max(0, position - window + 1) if window is not None else 0
        k = keys[lo:position + 1].float().repeat_interleave(group, dim=1)  # [n, H, D]
        v = values[lo:position + 1].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[row].double(), k.double()) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        out[row] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v.double()).float()
    return out


def check_decode_kernel(head_dim: int, cache_dtype, window: int | None, softcap: float | None) -> None:
    """The decode kernel against the torch reference and the softmax written out, over sequences within a block, across
    blocks and over several parts of 512 keys."""
    kernels = built_kernels()
    torch.manual_seed(0)
    num_heads, num_kv_heads, block_size = 6, 2, 16
    seq_lens = [1, 9, 10, 11, 16, 17, 40, 100, 1200]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 4
    kv_cache = (torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim) * 3).to(cache_dtype)
    rng = np.random.default_rng(1)
    tables = [rng.choice(num_blocks, -(-n // block_size), replace=False).astype(np.int64) for n in seq_lens]
    meta = decode_metadata(tables, seq_lens)
    query = torch.randn(len(seq_lens), num_heads, head_dim)
    actual = kernels.paged_decode_attention(query, kv_cache[0], kv_cache[1], meta.decode_block_tables, meta.decode_seq_lens,
                                            head_dim**-0.5, 0, window or 0, softcap or 0.0)
    reference = reference_decode_attention(query, kv_cache, meta, head_dim**-0.5, window=window, softcap=softcap)
    torch.testing.assert_close(actual, reference, atol=2e-5, rtol=1e-4)
    for index, (table, length) in enumerate(zip(tables, seq_lens)):
        positions = torch.arange(length)
        slots = torch.from_numpy(table)[positions // block_size] * block_size + positions % block_size
        keys, values = (kv_cache[i].view(-1, num_kv_heads, head_dim)[slots] for i in (0, 1))
        expected = brute_force_attention(query[index:index + 1], keys, values, [length - 1], window, head_dim**-0.5, softcap)
        torch.testing.assert_close(actual[index:index + 1], expected, atol=2e-5, rtol=1e-4)


def check_prefill_kernel(cache_dtype, window: int | None, softcap: float | None) -> None:
    """Chunks fresh and after context, shorter and longer than the window, one of tiles of many rows; the kernel, the
    torch reference and the softmax written out agree."""
    kernels = built_kernels()
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size = 6, 2, 32, 16
    chunks = [(0, 5), (0, 50), (30, 7), (100, 40), (3, 200)]  # (context, query_len)
    num_blocks = sum(-(-(c + q) // block_size) for c, q in chunks) + 4
    kv_cache = (torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim) * 3).to(cache_dtype)
    rng = np.random.default_rng(2)
    total = sum(q for _, q in chunks)
    query = torch.randn(total, num_heads, head_dim)
    prefills, start = [], 0
    for context, query_len in chunks:
        table = torch.from_numpy(rng.choice(num_blocks, -(-(context + query_len) // block_size), replace=False).astype(np.int64))
        prefills.append(PrefillChunk(start, query_len, context + query_len, table))
        start += query_len
    paged = PagedPrefills.of(prefills, torch.device("cpu"))
    out = torch.zeros(total, num_heads, head_dim)
    kernels.paged_prefill_attention(query, kv_cache[0], kv_cache[1], paged.block_tables, paged.query_starts, paged.query_lens,
                                    paged.seq_lens, head_dim**-0.5, out, 0, window or 0, softcap or 0.0)
    for chunk in prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        positions = torch.arange(chunk.seq_len)
        slots = chunk.block_table[positions // block_size] * block_size + positions % block_size
        keys, values = (kv_cache[i].view(-1, num_kv_heads, head_dim)[slots] for i in (0, 1))
        own = slice(chunk.context_len, chunk.seq_len)
        reference = reference_prefill_attention(query[rows], keys[own].float(), values[own].float(), kv_cache, chunk,
                                                head_dim**-0.5, window=window, softcap=softcap)
        torch.testing.assert_close(out[rows], reference, atol=2e-5, rtol=1e-4)
        expected = brute_force_attention(query[rows], keys, values, range(chunk.context_len, chunk.seq_len), window,
                                         head_dim**-0.5, softcap)
        torch.testing.assert_close(out[rows], expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 24])  # the three-pass route and the online-softmax one
@pytest.mark.parametrize("window", [1, 10, 16, 37, 520])  # mid-block, a whole block, over a part of 512 keys
def test_decode_kernel_with_a_sliding_window_attends_to_the_last_keys(head_dim, window, cache_dtype):
    check_decode_kernel(head_dim, cache_dtype, window, None)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 10, 16, 70])
def test_prefill_kernel_with_a_sliding_window_hides_the_keys_each_row_has_passed(window, cache_dtype):
    check_prefill_kernel(cache_dtype, window, None)


# The scores here are a few units across: a cap of 4 bends most of them.
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 24])
@pytest.mark.parametrize("window", [None, 37])
def test_decode_kernel_soft_caps_the_scaled_scores(head_dim, window, cache_dtype):
    check_decode_kernel(head_dim, cache_dtype, window, 4.0)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 16])
def test_prefill_kernel_soft_caps_the_scaled_scores(window, cache_dtype):
    check_prefill_kernel(cache_dtype, window, 4.0)
