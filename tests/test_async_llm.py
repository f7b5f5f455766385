"""AsyncLLM in-process: incremental outputs, and a cancelled consumer aborts its request."""

import asyncio

import pytest

from pagedserve import SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.sampling_params import RequestOutputKind


@pytest.fixture(scope="module")
def async_llm(tiny_models):
    from pagedserve.engine.async_llm import AsyncLLM

    engine = AsyncLLM(EngineConfig(model=str(tiny_models["llama"]), kv_cache_memory=8 * 1024**2))
    yield engine
    engine.shutdown()
    assert not engine.client.is_alive()


def test_generate_streams_deltas_that_add_up(async_llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def main():
        deltas = [out async for out in async_llm.generate({"prompt_token_ids": [5, 6, 7]}, params, "stream-1")]
        final_params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
        finals = [out async for out in async_llm.generate({"prompt_token_ids": [5, 6, 7]}, final_params, "final-1")]
        return deltas, finals

    deltas, finals = asyncio.run(main())
    assert len(deltas) == 12 and len(finals) == 1
    assert sum((d.outputs[0].token_ids for d in deltas), []) == finals[0].outputs[0].token_ids
    assert "".join(d.outputs[0].text for d in deltas) == finals[0].outputs[0].text
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "length"


def test_generate_on_an_engine_whose_model_gives_no_text_is_refused(tiny_models):
    from pagedserve.engine.async_llm import AsyncLLM

    engine = AsyncLLM(EngineConfig(model=str(tiny_models["llama"]), runner="pooling", kv_cache_memory=8 * 1024**2))

    async def main():
        return [out async for out in engine.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2), "text-1")]

    try:
        with pytest.raises(ValueError, match="this engine does not give text: that takes an engine with runner generate"):
            asyncio.run(main())
        assert engine.num_in_flight() == 0
    finally:
        engine.shutdown()


def test_cancelled_consumer_aborts_and_frees_blocks(async_llm):
    params = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def consume(seen: list):
        async for out in async_llm.generate({"prompt_token_ids": [9, 8, 7]}, params, "to-cancel"):
            seen.append(out)

    async def main():
        seen = []
        task = asyncio.ensure_future(consume(seen))
        while len(seen) < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The engine reports its state after every step; wait for the one after the abort.
        for _ in range(200):
            await asyncio.sleep(0.05)
            usage = async_llm.metrics.kv_cache_usage[0]._value.get()
            running = async_llm.metrics.num_running[0]._value.get()
            if usage == 0 and running == 0:
                break
        return seen, usage, running

    seen, usage, running = asyncio.run(main())
    assert 3 <= len(seen) < 900
    assert usage == 0 and running == 0
    assert not async_llm.front_end.has_unfinished_requests()


def _allowed_cpus(pid: int) -> dict[int, list[int]]:
    """Each thread of process pid: the CPUs it may run on."""
    import glob
    import os

    return {int(os.path.basename(task)): sorted(os.sched_getaffinity(int(os.path.basename(task))))
            for task in glob.glob(f"/proc/{pid}/task/*")}


def test_the_engine_core_pins_its_threads_for_a_lone_decode_and_an_engine_in_the_callers_process_does_not(
        async_llm, default_llm):
    import os

    from pagedserve.executor.cpu_host import cpu_core, cpus_one_per_core_first

    ours = sorted(os.sched_getaffinity(0))
    if len(ours) < 2:
        pytest.skip("one CPU: nothing to pin apart")
    order = cpus_one_per_core_first(ours, cpu_core)
    pid = async_llm.client.process.pid

    def run(prompt_len: int, max_tokens: int) -> dict[int, list[int]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

        async def main():
            return [out async for out in async_llm.generate({"prompt_token_ids": list(range(5, 5 + prompt_len))}, params,
                                                             f"pin-{prompt_len}-{max_tokens}")]

        asyncio.run(main())
        return _allowed_cpus(pid)

    # Its last steps decoded one token each: the core's main thread (OpenMP's thread 0) on the first CPU, another
    # torch thread alone on the next (one per core first).
    threads = run(3, 6)
    assert threads[pid] == order[:1]
    assert order[1] in {cpus[0] for cpus in threads.values() if len(cpus) == 1}
    # Its one step was an 8-token prompt: every torch thread free on all CPUs again.
    threads = run(8, 1)
    assert threads[pid] == ours
    assert order[1] not in {cpus[0] for cpus in threads.values() if len(cpus) == 1}
    # The offline LLM runs its engine in this process (default_llm): nothing here is pinned.
    assert all(cpus == ours for cpus in _allowed_cpus(os.getpid()).values())
