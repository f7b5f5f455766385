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
