"""The rate of matrix products on this machine through torch: float32, bfloat16 and int8 GEMMs, each the faster of
torch's own GEMM and oneDNN's on a weight reordered for it (what the engine runs; oneDNN uses AVX-512, AVX-512 BF16 or
AMX tiles where the processor has them). `bench machine` reports these rates; the engine's `dtype auto` compares the
bfloat16 and float32 ones."""

from __future__ import annotations

import time

import torch

# A product this quick at one size is timed at twice the size too, up to this many doublings: a library may not split
# a small product among every thread, and the limit is the rate the machine reaches, not the rate of one size.
_GROW_BELOW_S, _MAX_DOUBLINGS = 0.05, 2


def matmul_gflop_s(dtype: torch.dtype, size: int, repeats: int) -> float | None:
    """The best GFLOP/s of n x n by n x n products in dtype (int8: into int32), n from size up to 4 x size where the
    products take little time; each the faster of torch's own GEMM and oneDNN's on a weight reordered for it (what
    the engine runs), best of repeats. None where torch has no such product on this machine."""
    return max_rate_and_size(dtype, size, repeats)[0]


def max_rate_and_size(dtype: torch.dtype, size: int, repeats: int) -> tuple[float | None, int]:
    """(the best GFLOP/s of matmul_gflop_s, the n it was reached at)."""
    best, best_size = None, size
    for doubling in range(_MAX_DOUBLINGS + 1):
        n = size << doubling
        rate = matmul_rate_at(dtype, n, repeats)
        if rate is None:
            break
        if best is None or rate > best:
            best, best_size = rate, n
        if 2 * n**3 / (rate * 1e9) >= _GROW_BELOW_S:
            break
    return best, best_size


def matmul_rate_at(dtype: torch.dtype, size: int, repeats: int) -> float | None:
    """GFLOP/s of one size x size by size x size product in dtype, the faster of torch's GEMM and oneDNN's."""
    if dtype == torch.int8:
        a = torch.randint(-64, 64, (size, size), dtype=torch.int8)
        b = torch.randint(-64, 64, (size, size), dtype=torch.int8)
        products = [lambda: torch._int_mm(a, b)]  # the int8 x int8 -> int32 GEMM, where torch provides one
    else:
        a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        products = [lambda: torch.mm(a, b), *_onednn_product(a, b)]
    rates = [rate for rate in (product_rate(product, size, repeats) for product in products) if rate is not None]
    return max(rates, default=None)


def _onednn_product(a: torch.Tensor, b: torch.Tensor) -> list:
    """a @ b through oneDNN's linear on b reordered for it, where this torch and processor have it for a's dtype."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(b.T.contiguous(), a.shape[0])
    except RuntimeError:
        return []
    return [lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")]


def product_rate(product, size: int, repeats: int) -> float | None:
    """GFLOP/s of a size x size by size x size product (a call of `product`), best of repeats after a first call; None
    where it raises (no such product here)."""
    try:
        product()  # the first call sets the kernel up
    except RuntimeError:
        return None
    best = min(seconds(product) for _ in range(repeats))
    return 2 * size**3 / best / 1e9


def seconds(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start
