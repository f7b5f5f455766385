"""The machine's own limits, measured: memory read bandwidth, the rate of matrix products in float32, bfloat16 and int8
through torch (whose oneDNN kernels use AVX-512 or AMX tiles where the processor has them, and plain FMAs where it has
not), and the rate at which the vector units multiply bytes (the integer products of GGUF blocks on input rounded to
8 bits, where torch's int8 GEMM may have no kernel for these vectors). A step's time is judged against these: a decode
step reads the weights once (bandwidth), a prefill step multiplies (the product rate of what its GEMMs multiply in)."""

from __future__ import annotations

import time

import torch

from pagedserve.benchmarks.report import print_table, write_json
from pagedserve.cpu_features import cpu_features
from pagedserve.executor.vector_rate import int8_vector_gop_s


def read_bandwidth_gb_s(num_bytes: int, repeats: int) -> float:
    """GB/s of reading a float32 tensor of num_bytes (far larger than the caches) on every thread; best of repeats."""
    tensor = torch.ones(num_bytes // 4, dtype=torch.float32)
    best = min(_seconds(lambda: tensor.sum()) for _ in range(repeats))
    return num_bytes / best / 1e9


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
        rate = _matmul_rate(dtype, n, repeats)
        if rate is None:
            break
        if best is None or rate > best:
            best, best_size = rate, n
        if 2 * n**3 / (rate * 1e9) >= _GROW_BELOW_S:
            break
    return best, best_size


def _matmul_rate(dtype: torch.dtype, size: int, repeats: int) -> float | None:
    """GFLOP/s of one size x size by size x size product in dtype, the faster of torch's GEMM and oneDNN's."""
    if dtype == torch.int8:
        a = torch.randint(-64, 64, (size, size), dtype=torch.int8)
        b = torch.randint(-64, 64, (size, size), dtype=torch.int8)
        products = [lambda: torch._int_mm(a, b)]  # the int8 x int8 -> int32 GEMM, where torch provides one
    else:
        a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        products = [lambda: torch.mm(a, b), *_onednn_product(a, b)]
    rates = [rate for rate in (_rate(product, size, repeats) for product in products) if rate is not None]
    return max(rates, default=None)


def int8_gop_s(size: int, repeats: int) -> float | None:
    """The machine's rate of int8 products: the better of torch's int8 GEMM (matmul_gflop_s) and the vector units';
    None where it has neither."""
    return max((rate for rate in (matmul_gflop_s(torch.int8, size, repeats), int8_vector_gop_s(repeats)) if rate is not None), default=None)


def _onednn_product(a: torch.Tensor, b: torch.Tensor) -> list:
    """a @ b through oneDNN's linear on b reordered for it, where this torch and processor have it for a's dtype."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(b.T.contiguous(), a.shape[0])
    except RuntimeError:
        return []
    return [lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")]


def _rate(product, size: int, repeats: int) -> float | None:
    try:
        product()  # the first call sets the kernel up
    except RuntimeError:
        return None
    best = min(_seconds(product) for _ in range(repeats))
    return 2 * size**3 / best / 1e9


def _seconds(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def run(args) -> dict:
    features = cpu_features()
    record = {
        "benchmark": "machine", "cpu": features.model_name, "isa": features.isa,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
        "read_bandwidth_gb_s": read_bandwidth_gb_s(args.memory_mib * 2**20, args.repeats),
        "matmul_size": args.matmul_size,
    }
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("int8", torch.int8)):
        record[f"{name}_gflop_s"], record[f"{name}_matmul_size"] = max_rate_and_size(dtype, args.matmul_size, args.repeats)
    record["int8_vector_gop_s"] = int8_vector_gop_s(args.repeats)
    print_table(f"machine limits ({record['cpu']}; {' '.join(record['isa']) or 'no AVX2'}; {record['threads']} threads)", [
        ("memory read, GB/s", record["read_bandwidth_gb_s"]),
        *((f"{name} matmul, GFLOP/s (best at n = {record[f'{name}_matmul_size']})", record[f"{name}_gflop_s"] or "not available")
          for name in ("float32", "bfloat16", "int8")),
        ("int8 products on the vector units (registers only), GOP/s", record["int8_vector_gop_s"] or "not available"),
    ])
    write_json(args.json, record)
    return record
