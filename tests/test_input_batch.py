"""The flat batch a step runs on, against a token-by-token reading of what each request holds: decodes (gathered
as plain integers) and prompt chunks (as arrays) must lay out the same way."""

import random

import torch

from pagedserve.executor.input_batch import RunnerRequests, RunnerRequestState, prepare_inputs
from pagedserve.layers.attention.backend import AttentionBackend
from pagedserve.sampling_params import SamplingParams

BLOCK_SIZE = 4


class _LayoutOnly(AttentionBackend):
    name = "layout-only"

    def forward(self, *args):
        raise NotImplementedError


def _requests(rng: random.Random) -> tuple[dict[str, RunnerRequestState], dict[str, int], dict[str, int]]:
    """Decodes, prompt chunks (one with prompt logprobs), a decode that is a prompt's last token, a verification; and
    each one's computed tokens."""
    states, scheduled, computed = {}, {}, {}
    shapes = [("decode", 1, 0)] * 6 + [("chunk", 5, 0), ("chunk", 3, 0), ("last-prompt-token", 1, 0), ("verify", 3, 2)]
    for index, (kind, num_tokens, num_drafts) in enumerate(shapes):
        num_computed = rng.randint(0, 20)
        known = num_computed + (num_tokens if kind != "chunk" else num_tokens + rng.randint(0, 4))
        blocks = rng.sample(range(100), -(-known // BLOCK_SIZE))
        num_prompt = known if kind != "decode" else rng.randint(1, num_computed + 1)
        params = SamplingParams(temperature=0.0, prompt_logprobs=2 if kind in ("chunk", "last-prompt-token") else None)
        request_id = f"{kind}-{index}"
        states[request_id] = RunnerRequestState(request_id, [rng.randrange(1000) for _ in range(known)], num_prompt, params, blocks,
                                                num_drafts=num_drafts)
        scheduled[request_id], computed[request_id] = num_tokens, num_computed
    rng.shuffle(order := list(scheduled))
    return states, {request_id: scheduled[request_id] for request_id in order}, computed


def _assert_laid_out_as_requests_say(requests: RunnerRequests, states: dict[str, RunnerRequestState], computed: dict[str, int],
                                     scheduled: dict[str, int]) -> None:
    """prepare_inputs against each scheduled request's tokens, blocks and computed count read one by one."""
    inputs = prepare_inputs(requests, scheduled, BLOCK_SIZE, _LayoutOnly(), torch.device("cpu"))
    order = [rid for rid in scheduled if scheduled[rid] == 1] + [rid for rid in scheduled if scheduled[rid] != 1]
    ids, positions, slots, logits_rows, samplers, prompt_logprobs, offset = [], [], [], [], [], [], 0
    for request_id in order:
        state, count, start = states[request_id], scheduled[request_id], computed[request_id]
        scored = []  # (flat index, prompt token scored) for the logits at each position that predict a prompt token
        for position in range(start, start + count):
            ids.append(state.token_ids[position])
            positions.append(position)
            slots.append(state.block_ids[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
            if state.sampling_params.prompt_logprobs is not None and state.prompt_logprobs_start <= position < state.num_prompt_tokens - 1:
                scored.append((offset + position - start, state.token_ids[position + 1]))
        if scored:
            prompt_logprobs.append((request_id, *map(list, zip(*scored))))
        if start + count == len(state.token_ids):
            samplers.append(request_id)
            logits_rows.extend(range(offset + count - 1 - state.num_drafts, offset + count))
        offset += count
    meta = inputs.attn_metadata
    assert inputs.input_ids.tolist() == ids and inputs.positions.tolist() == positions
    assert meta.slot_mapping.tolist() == slots
    assert inputs.sampling_req_ids == samplers and inputs.logits_indices.tolist() == logits_rows
    decodes = [rid for rid in order if scheduled[rid] == 1]
    assert meta.num_decode_tokens == len(decodes)
    seq_lens, tables = (meta.decode_seq_lens.tolist(), meta.decode_block_tables.tolist()) if decodes else ([], [])
    assert seq_lens == [computed[rid] + 1 for rid in decodes]
    for row, request_id in zip(tables, decodes, strict=True):
        used = computed[request_id] // BLOCK_SIZE + 1
        assert row[:used] == states[request_id].block_ids[:used]
    for chunk, request_id in zip(meta.prefills, [rid for rid in order if scheduled[rid] != 1]):
        assert chunk.seq_len == computed[request_id] + scheduled[request_id]
        assert chunk.block_table.tolist() == states[request_id].block_ids[: -(-chunk.seq_len // BLOCK_SIZE)]
    assert [(piece.request_id, piece.flat_indices, piece.target_token_ids) for piece in inputs.prompt_logprobs] == prompt_logprobs


def test_decodes_and_chunks_lay_out_token_by_token_as_their_requests_say():
    for seed in range(20):
        states, scheduled, computed = _requests(random.Random(seed))
        requests = RunnerRequests()
        for request_id, state in states.items():
            requests.add(state, computed[request_id])
        _assert_laid_out_as_requests_say(requests, states, computed, scheduled)


def test_a_run_of_steps_lays_out_as_its_requests_say():
    """The runner's requests through many steps as the runner changes them (requests come and go and reuse rows, sample,
    advance, take drafts and drop rejected ones, get a token from another pipeline stage, recompute after preemption);
    every step's batch is laid out as each request's own tokens and computed count say."""
    rng = random.Random(1)
    requests, states, computed, next_id = RunnerRequests(), {}, {}, 0
    for _ in range(300):
        while len(states) < 24 or rng.random() < 0.1:  # new requests, some resumed with known tokens to recompute
            request_id, next_id = f"r{next_id}", next_id + 1
            known = rng.randint(1, 40)
            num_prompt = known if rng.random() < 0.7 else rng.randint(1, known)
            params = SamplingParams(temperature=0.0, prompt_logprobs=1 if rng.random() < 0.1 else None)
            state = RunnerRequestState(request_id, [rng.randrange(1000) for _ in range(known)], num_prompt, params,
                                       rng.sample(range(1000), -(-(known + 200) // BLOCK_SIZE)))
            computed[request_id] = rng.randint(0, known - 1)
            requests.add(state, computed[request_id])
            states[request_id] = state
        for request_id in rng.sample(sorted(states), 2):
            if rng.random() < 0.3:
                requests.remove(request_id)
                del states[request_id], computed[request_id]
        scheduled = {}
        for request_id in rng.sample(sorted(states), rng.randint(1, len(states))):  # a shuffled subset
            state, left = states[request_id], len(states[request_id].token_ids) - computed[request_id]
            if left == 1 and rng.random() < 0.15:  # drafts, verified with the last known token
                requests.extend_tokens(state, [rng.randrange(1000) for _ in range(rng.randint(1, 3))])
                state.num_drafts = len(state.token_ids) - computed[request_id] - 1
                scheduled[request_id] = state.num_drafts + 1
            else:
                scheduled[request_id] = left if left > 1 and rng.random() < 0.5 else 1
        _assert_laid_out_as_requests_say(requests, states, computed, scheduled)
        _run_as_the_runner_would(requests, states, computed, scheduled, rng)


def _run_as_the_runner_would(requests: RunnerRequests, states: dict[str, RunnerRequestState], computed: dict[str, int],
                             scheduled: dict[str, int], rng: random.Random) -> None:
    """After the step: the requests at the end of their tokens get one (sampled, or a verification's accepted drafts and
    token), and every scheduled request has its tokens computed."""
    finishing = [rid for rid in scheduled if computed[rid] + scheduled[rid] == len(states[rid].token_ids)]
    plain = [rid for rid in finishing if not states[rid].num_drafts]
    if rng.random() < 0.5:
        requests.append_sampled(requests.of(plain), [rng.randrange(1000) for _ in plain], requests.rows_of(plain))
    else:  # tokens from another pipeline stage, one by one
        for request_id in plain:
            requests.extend_tokens(states[request_id], [rng.randrange(1000)])
    requests.advance(scheduled)
    for request_id in scheduled:
        computed[request_id] += scheduled[request_id]
    for request_id in finishing:
        state = states[request_id]
        if state.num_drafts:
            accepted = rng.randint(0, state.num_drafts)
            requests.truncate_tokens(state, len(state.token_ids) - state.num_drafts + accepted)
            state.num_drafts = 0
            requests.extend_tokens(state, [rng.randrange(1000)])
            computed[request_id] = len(state.token_ids) - 1
            requests.set_num_computed(request_id, computed[request_id])
        assert requests.num_computed_of(request_id) == computed[request_id]


def test_block_table_rows_follow_each_request_as_blocks_come_and_go():
    """Requests arrive, gain blocks, give back trailing blocks and leave, past the table's first size in both
    dimensions; each live request's row always starts with exactly its block ids, and no two share a row."""
    rng = random.Random(0)
    requests, live, next_id = RunnerRequests(), {}, 0
    params = SamplingParams(temperature=0.0)
    for _ in range(2000):
        action = rng.random()
        if action < 0.3 or not live:
            request_id, next_id = f"r{next_id}", next_id + 1
            blocks = rng.sample(range(10_000), rng.randint(0, 8))
            requests.add(RunnerRequestState(request_id, [1], 1, params, list(blocks)), 0)
            live[request_id] = blocks
        elif action < 0.8:
            request_id = rng.choice(list(live))
            kept = -1 if rng.random() < 0.8 else rng.randint(0, len(live[request_id]))
            new_blocks = rng.sample(range(10_000), rng.randint(0, 12))
            requests.add_blocks(request_id, new_blocks, kept)
            live[request_id] = (live[request_id] if kept < 0 else live[request_id][:kept]) + new_blocks
        else:
            request_id = rng.choice(list(live))
            requests.remove(request_id)
            del live[request_id]
        rows = [requests[request_id].row for request_id in live]
        assert len(set(rows)) == len(rows)
        for request_id, blocks in live.items():
            state = requests[request_id]
            assert state.block_ids == blocks
            assert requests.block_tables.ids[state.row, : len(blocks)].tolist() == blocks
    assert requests.block_tables.ids.shape[0] > 16 and requests.block_tables.ids.shape[1] > 64
