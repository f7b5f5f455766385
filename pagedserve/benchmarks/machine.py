"""The machine's own limits, measured: memory read bandwidth, the rate of matrix products in float32, bfloat16 and int8
through torch (whose oneDNN kernels use AVX-512 or AMX tiles where the processor has them, and plain FMAs where it has
not), and the rate at which the vector units multiply bytes (the integer products of GGUF blocks on input rounded to
8 bits, where torch's int8 GEMM may have no kernel for these vectors). A step's time is judged against these: a decode
step reads the weights once (bandwidth), a prefill step multiplies (the product rate of what its GEMMs multiply in)."""

from __future__ import annotations

import torch

from pagedserve.benchmarks.report import print_table, write_json
from pagedserve.cpu_features import cpu_features
from pagedserve.executor.matmul_rate import matmul_gflop_s, max_rate_and_size, seconds
from pagedserve.executor.vector_rate import int8_vector_gop_s


def read_bandwidth_gb_s(num_bytes: int, repeats: int) -> float:
    """GB/s of reading a float32 tensor of num_bytes (far larger than the caches) on every thread; best of repeats."""
    tensor = torch.ones(num_bytes // 4, dtype=torch.float32)
    best = min(seconds(lambda: tensor.sum()) for _ in range(repeats))
    return num_bytes / best / 1e9


def int8_gop_s(size: int, repeats: int) -> float | None:
    """The machine's rate of int8 products: the better of torch's int8 GEMM (matmul_gflop_s) and the vector units';
    None where it has neither."""
    return max((rate for rate in (matmul_gflop_s(torch.int8, size, repeats), int8_vector_gop_s(repeats)) if rate is not None), default=None)


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
