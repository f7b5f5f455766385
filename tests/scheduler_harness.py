"""A scheduler + KV manager with a fake model, for tests that need no weights."""

from __future__ import annotations

import random
import zlib

from pagedserve.core.contracts import ModelRunnerOutput, SchedulerOutput
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams

EOS = 2


def make_scheduler(num_blocks=64, block_size=4, max_model_len=256, budget=32, max_num_seqs=16, caching=True,
                   policy="fcfs", threshold=0, speculative=None, stall=None):
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(kv, max_model_len, budget, max_num_seqs, threshold, policy, max_decode_stall=stall, speculative=speculative)


def make_request(request_id, prompt_len=None, max_tokens=8, prompt=None, priority=0, arrival=None, group=None, eos=False):
    # Tokens from a stable digest of the id (str's hash changes from process to process, and two ids whose prompts came
    # out equal would share prefix-cache blocks in some runs and not in others).
    start = zlib.crc32(request_id.encode())
    prompt = prompt if prompt is not None else [100 + (start + i) % 50 for i in range(prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, eos_token_ids=[EOS] if eos else [])
    return Request(request_id, prompt, params, arrival_time=arrival, priority=priority, group_id=group)


def fake_run(scheduler_output: SchedulerOutput, scheduler: Scheduler, rng: random.Random | None = None) -> ModelRunnerOutput:
    """Sample a token for every request that reached the end of its known tokens; accept a random prefix of each
    request's drafts, and propose random drafts where the scheduler asks for them."""
    output = ModelRunnerOutput(sampled_token_ids={})
    for request_id in scheduler_output.num_scheduled_tokens:
        request = scheduler.requests[request_id]
        if request.num_computed_tokens >= request.num_tokens:
            output.sampled_token_ids[request_id] = rng.randrange(0, 60) if rng else 7
            drafts = scheduler_output.drafts_to_verify.get(request_id)
            if drafts:
                output.accepted_token_ids[request_id] = drafts[: rng.randint(0, len(drafts)) if rng else len(drafts)]
            if request_id in scheduler_output.propose_for:
                k = scheduler.speculative.num_speculative_tokens
                output.proposed_drafts[request_id] = [rng.randrange(0, 60) for _ in range(rng.randint(0, k))] if rng else [7] * k
    return output


def step(scheduler: Scheduler, rng: random.Random | None = None):
    output = scheduler.schedule()
    return output, scheduler.update_from_output(output, fake_run(output, scheduler, rng))


def check_block_accounting(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    free_ids = set(pool.free_queue)
    used = [b for b in pool.blocks if b.ref_cnt > 0]
    assert len(free_ids) + len(used) == pool.num_blocks, "free + used != total"
    assert not any(b.block_id in free_ids for b in used), "a block is both free and referenced"
    assert all(b.ref_cnt >= 0 for b in pool.blocks)
    remote = scheduler.remote_kv
    held = list(remote.held.values()) if remote is not None else []  # blocks a KV connector holds for another instance
    refs = {}
    for blocks in (*kv.req_to_blocks.values(), *held):
        for b in blocks:
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
    assert all(pool.blocks[i].ref_cnt == n for i, n in refs.items()), "ref counts disagree with the owners"
    assert sum(refs.values()) == sum(b.ref_cnt for b in pool.blocks)
    # Requests whose KV is still arriving keep their blocks, aborted or not.
    assert set(kv.req_to_blocks) <= set(scheduler.requests) | (set(remote.loading) if remote is not None else set())
    assert kv.slot_capacity == {request_id: len(blocks) * kv.block_size for request_id, blocks in kv.req_to_blocks.items()}, \
        "the decode path's capacities disagree with the blocks held"
