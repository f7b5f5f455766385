"""What glibc's malloc does with large allocations, which the engine's processes set it up around
(executor/cpu_host.py keeps freed memory; the model runner keeps its large logits tensor across steps)."""

# glibc's largest mmap threshold (its upper bound on 64-bit systems): it serves a larger allocation with freshly
# mapped pages and unmaps them when freed, so a tensor that size made every step pays a page fault per 4 KiB every
# step (on a VM, more than its GEMM may take).
FRESH_PAGES_ABOVE_BYTES = 32 << 20
