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



@pytest.mark.slow
def test_long_prefills_reuse_freed_host_memory():
    """With the engine's malloc settings a long prefill reuses the pages the previous one freed, where glibc's
    defaults give them back to the OS and page-fault hundreds of MB of activations in again (docs/cpu.md)."""
    import random
    import resource

    from pagedserve import LLM, SamplingParams

    # An engine of its own, its KV cache's pages all mapped before the count begins (mapping them counts as faults of
    # this process), so that only the prefills' own pages count: the kernel moves 4 KB pages of a cache left idle for
    # minutes (the session's shared engine), and writing K/V into them faults them back in.
    llm = LLM(max_model_len=2048, kv_cache_memory=256 * 1024**2)
    llm.llm_engine.call_utility("wait_for_kv_cache_mapping", 120)
    rng = random.Random(0)
    faulted_mb = []
    for _ in range(3):
        prompt = [rng.randrange(100, 40000) for _ in range(2000)]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)
        faulted_mb.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * 4096 / 2**20)
    assert sum(faulted_mb[1:]) < 100, faulted_mb


def test_steps_of_many_rows_keep_their_logits_memory(tiny_models):
    """Logits of 200 rows over a 49152-token vocabulary are past what glibc keeps when freed (host_memory.py): the runner
    keeps one tensor for them, so decode steps of that many rows fault no pages in for them, and each request's tokens
    are those it gets in smaller batches, on fresh logits."""
    import random
    import resource

    from conftest import greedy, token_ids_of

    from pagedserve import LLM

    llm = LLM(str(tiny_models["llama"]), dtype="float32", kv_cache_memory=64 * 1024**2, max_num_seqs=256)
    llm.llm_engine.call_utility("wait_for_kv_cache_mapping", 120)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(4)]} for _ in range(200)]
    token_ids_of(llm.generate(prompts, greedy(2), use_tqdm=False))  # the first steps of that many rows make what they keep
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    together = token_ids_of(llm.generate(prompts, greedy(8), use_tqdm=False))
    faulted_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * 4096 / 2**20
    assert faulted_mb < 200 * 49152 * 4 / 2**20, faulted_mb  # one step's logits, 37.5 MiB: eight steps would fault 300
    assert together == token_ids_of(llm.generate(prompts[:100], greedy(8), use_tqdm=False)) + \
        token_ids_of(llm.generate(prompts[100:], greedy(8), use_tqdm=False))


def resident_fraction(tensor: torch.Tensor) -> float:
    """Share of the tensor's whole pages that are mapped in (mincore)."""
    import ctypes
    import mmap

    from pagedserve.executor.cpu_host import libc

    page = mmap.PAGESIZE
    start = -(-tensor.data_ptr() // page) * page
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page * page
    pages = (end - start) // page
    residency = (ctypes.c_ubyte * pages)()
    assert libc().mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), residency) == 0
    return sum(byte & 1 for byte in residency) / pages


def fresh_pages(shape, dtype=torch.float32) -> torch.Tensor:
    """A tensor on an anonymous mapping of its own: no page mapped in yet, whatever malloc holds."""
    import mmap

    size = int(torch.Size(shape).numel()) * dtype.itemsize
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(mapping, dtype=dtype).view(shape)
    tensor.mapping = mapping  # kept alive with the tensor
    return tensor


def test_prefault_maps_every_page_only_when_allowed_and_keeps_contents():
    import threading
    import time

    from pagedserve.executor.cpu_host import prefault_in_background

    caches = [fresh_pages((2, 300, 16, 2, 64)) for _ in range(3)]  # 300 blocks of 8 KB per K or V
    caches[1][1, 7].fill_(3.0)  # K/V an engine wrote before the thread reached them
    assert max(resident_fraction(cache) for cache in caches) < 0.05
    allowed = threading.Event()
    thread = prefault_in_background(caches, may_run=allowed.is_set)
    time.sleep(0.3)
    assert max(resident_fraction(cache) for cache in caches) < 0.05  # the engine is busy: nothing mapped
    allowed.set()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert all(resident_fraction(cache) == 1.0 for cache in caches)
    assert caches[1][1, 7].eq(3.0).all() and caches[1].sum().item() == 3.0 * 16 * 2 * 64 and not caches[0].any()


def _smaps_field(address: int, field: str) -> list[str]:
    """The values of a field (VmFlags, AnonHugePages, ...) of the mapping that holds address (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and head == f"{field}:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _kernel_gathers_huge_pages() -> bool:
    """Whether this kernel gathers mapped 4 KB pages into a 2 MB page on request (MADV_COLLAPSE, Linux 6.1+), asked of
    a mapping of the test's own."""
    from pagedserve.executor.cpu_host import _HUGE_PAGE, _MADV_COLLAPSE, _MADV_HUGEPAGE, _madvise

    scratch = fresh_pages((2 * _HUGE_PAGE,), torch.uint8)
    scratch.fill_(1)
    start = -(-scratch.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    madvise = _madvise()
    return madvise(start, _HUGE_PAGE, _MADV_HUGEPAGE) == 0 and madvise(start, _HUGE_PAGE, _MADV_COLLAPSE) == 0


def test_prefault_gathers_the_mapped_cache_into_2mb_pages_keeping_every_value():
    """Once every page is mapped, the prefault gathers each cache's pages into 2 MB pages (the decode attention reads
    every running sequence's blocks each step, and 4 KB pages make its reads wait on page walks) where the kernel can,
    else leaves them as they are; either way every value stays."""
    from pagedserve.executor.cpu_host import prefault_in_background

    caches = [fresh_pages((2, 2048, 16, 3, 64), torch.bfloat16) for _ in range(2)]  # 12 MB per K or V
    caches[1][1, 700].fill_(3.0)  # K/V an engine wrote before the thread reached them
    thread = prefault_in_background(caches)
    thread.join(timeout=60)
    assert not thread.is_alive()
    huge_kb = [int(_smaps_field(cache[half, 1024].data_ptr(), "AnonHugePages")[0]) for cache in caches for half in (0, 1)]
    if _kernel_gathers_huge_pages():
        assert min(huge_kb) >= 8 * 1024, huge_kb  # each half's whole 2 MB pages at least
    else:
        assert huge_kb == [0, 0, 0, 0]
    assert caches[1][1, 700].eq(3.0).all() and caches[1].float().sum().item() == 3.0 * 16 * 3 * 64 and not caches[0].any()


def test_the_kv_cache_asks_for_small_pages():
    """numpy asks for 2 MB pages under large arrays; the KV cache's zeros ask for 4 KB pages instead (MADV_NOHUGEPAGE),
    which a VM maps many times faster on first touch."""
    import numpy as np

    from pagedserve.executor.worker import zeroed

    cache = zeroed((2, 4096, 16, 2, 64), torch.bfloat16, torch.device("cpu"))  # 32 MB, a mapping of its own
    flags = _smaps_field(cache.data_ptr() + cache.numel(), "VmFlags")
    assert "nh" in flags and "hg" not in flags
    assert "hg" in _smaps_field(np.zeros(2**25, dtype=np.uint8).ctypes.data + 2**24, "VmFlags")  # what numpy asks for itself
    assert not cache.any()


def test_prefault_asks_before_every_call_so_a_step_waits_for_one_at_most():
    """Once the engine steps, the thread maps no more than the call it is in: one layer's K or V for a run of blocks."""
    import time

    from pagedserve.executor.cpu_host import _BLOCKS_PER_CALL, _running, prefault_in_background

    caches = [fresh_pages((2, 300, 16, 2, 64)) for _ in range(3)]
    answers = iter([True])
    thread = prefault_in_background(caches, may_run=lambda: next(answers, False))
    time.sleep(0.5)
    mapped_halves = [resident_fraction(cache[half]) for cache in caches for half in (0, 1)]
    assert mapped_halves[0] == pytest.approx(_BLOCKS_PER_CALL / 300, abs=0.02) and not any(mapped_halves[1:])
    assert thread.is_alive()  # waiting to be let go on
    _running[thread].set()
    thread.join(timeout=10)
    assert not thread.is_alive()


@pytest.mark.parametrize("prefault", [True, False])
def test_engine_maps_its_kv_cache_when_idle(prefault, tiny_models):
    """With prefault_kv_cache (the default) the engine maps every page of its cache once it is idle;
    outputs are unchanged. Without it no thread runs."""
    from conftest import engine_core_of, greedy, hf_greedy

    from pagedserve import LLM

    model_dir = tiny_models["llama"]
    llm = LLM(str(model_dir), kv_cache_memory=64 * 1024**2, prefault_kv_cache=prefault)
    worker = engine_core_of(llm).executor.worker
    prompts = [[1, 400, 500, 600, 700], list(range(100, 140))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(16), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(model_dir, prompts, 16)
    if not prefault:
        assert worker.kv_prefault is None
        return
    worker.wait_for_kv_cache_mapping(120)
    assert not worker.kv_prefault.thread.is_alive()
    assert all(resident_fraction(cache) == 1.0 for cache in worker.kv_caches)


def test_threads_per_rank_share_the_cores_among_every_rank_of_every_engine_core(monkeypatch):
    import os

    from pagedserve.config import EngineConfig
    from pagedserve.executor.cpu_host import threads_per_rank

    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert threads_per_rank(EngineConfig()) is None  # one rank alone: torch's own default
    assert threads_per_rank(EngineConfig(tensor_parallel_size=2)) == 4
    assert threads_per_rank(EngineConfig(pipeline_parallel_size=2, data_parallel_size=2)) == 2
    assert threads_per_rank(EngineConfig(tensor_parallel_size=3, data_parallel_size=3)) == 1
    assert threads_per_rank(EngineConfig(tensor_parallel_size=2, num_threads=3)) == 3  # the user's word wins


def test_each_rank_pins_its_threads_to_cpus_of_its_own_one_per_core_first():
    from pagedserve.config import EngineConfig
    from pagedserve.executor.cpu_host import cpus_one_per_core_first, thread_cpus

    # CPUs 0 and 1 share a core, as do 2 and 3: a thread per core before any core's second.
    siblings = {0: "a", 1: "a", 2: "b", 3: "b"}
    cpus = cpus_one_per_core_first([3, 1, 2, 0], siblings.__getitem__)
    assert cpus == [0, 2, 1, 3]
    assert cpus_one_per_core_first([0, 1, 2, 3], lambda cpu: cpu) == [0, 1, 2, 3]

    assert thread_cpus(EngineConfig(), 0, 2, True, cpus) == [0, 2]
    tp2 = EngineConfig(tensor_parallel_size=2)
    assert thread_cpus(tp2, 0, 2, True, cpus) == [0, 2] and thread_cpus(tp2, 1, 2, True, cpus) == [1, 3]
    assert thread_cpus(EngineConfig(pipeline_parallel_size=2), 1, 1, True, cpus) == [2]
    # Left to the OS: more threads than CPUs, pinning off, the caller's own process, ranks that may be elsewhere.
    assert thread_cpus(EngineConfig(tensor_parallel_size=3), 0, 2, True, cpus) is None
    assert thread_cpus(EngineConfig(pin_threads=False), 0, 2, True, cpus) is None
    assert thread_cpus(EngineConfig(), 0, 2, False, cpus) is None
    assert thread_cpus(EngineConfig(tensor_parallel_size=2, distributed_executor_backend="ray"), 0, 1, True, cpus) is None


def test_data_parallel_cores_leave_their_threads_to_the_os(monkeypatch):
    from pagedserve.config import EngineConfig
    from pagedserve.engine import dp_client

    configs = []

    class StartedCore:  # records the config each core would start with
        model_info = None

        def __init__(self, config, wait=True):
            configs.append(config)

        def wait_ready(self, *args):
            pass

    monkeypatch.setattr(dp_client, "AsyncMPClient", StartedCore)
    dp_client.DPAsyncMPClient(EngineConfig(data_parallel_size=2))
    assert len(configs) == 2 and not any(config.pin_threads for config in configs)


def test_threads_are_pinned_for_steps_of_one_token_and_free_for_larger_ones():
    from pagedserve.executor.cpu_host import PINNED_MAX_TOKENS, ThreadPinning

    calls = []

    class Kernels:
        def set_thread_cpus(self, cpus_of_thread):
            calls.append(cpus_of_thread)

    pinning = ThreadPinning(Kernels(), [0, 2], [0, 1, 2, 3])
    for tokens in (PINNED_MAX_TOKENS, PINNED_MAX_TOKENS, 128, 16, PINNED_MAX_TOKENS, 0):
        pinning.for_step(tokens)
    pinned, free = [[0], [2]], [[0, 1, 2, 3]] * 2
    assert calls == [pinned, free, pinned]  # only when the kind of step changes; an empty step changes nothing
