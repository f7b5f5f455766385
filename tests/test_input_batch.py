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


def _requests(rng: random.Random) -> tuple[dict[str, RunnerRequestState], dict[str, int]]:
    """Decodes, prompt chunks (one with prompt logprobs), a decode that is a prompt's last token, a verification."""
    states, scheduled = {}, {}
    shapes = [("decode", 1, 0)] * 6 + [("chunk", 5, 0), ("chunk", 3, 0), ("last-prompt-token", 1, 0), ("verify", 3, 2)]
    for index, (kind, num_tokens, num_drafts) in enumerate(shapes):
        computed = rng.randint(0, 20)
        known = computed + (num_tokens if kind != "chunk" else num_tokens + rng.randint(0, 4))
        blocks = rng.sample(range(100), -(-known // BLOCK_SIZE))
        num_prompt = known if kind != "decode" else rng.randint(1, computed + 1)
        params = SamplingParams(temperature=0.0, prompt_logprobs=2 if kind in ("chunk", "last-prompt-token") else None)
        request_id = f"{kind}-{index}"
        states[request_id] = RunnerRequestState(request_id, [rng.randrange(1000) for _ in range(known)], num_prompt, params, blocks,
                                                computed, num_drafts=num_drafts)
        scheduled[request_id] = num_tokens
    rng.shuffle(order := list(scheduled))
    return states, {request_id: scheduled[request_id] for request_id in order}


def test_decodes_and_chunks_lay_out_token_by_token_as_their_requests_say():
    for seed in range(20):
        states, scheduled = _requests(random.Random(seed))
        requests = RunnerRequests()
        for state in states.values():
            requests.add(state)
        inputs = prepare_inputs(requests, scheduled, BLOCK_SIZE, _LayoutOnly(), torch.device("cpu"))
        order = [rid for rid in scheduled if scheduled[rid] == 1] + [rid for rid in scheduled if scheduled[rid] != 1]
        ids, positions, slots, logits_rows, samplers, offset = [], [], [], [], [], 0
        for request_id in order:
            state, count = states[request_id], scheduled[request_id]
            for position in range(state.num_computed_tokens, state.num_computed_tokens + count):
                ids.append(state.token_ids[position])
                positions.append(position)
                slots.append(state.block_ids[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
            if state.num_computed_tokens + count == len(state.token_ids):
                samplers.append(request_id)
                logits_rows.extend(range(offset + count - 1 - state.num_drafts, offset + count))
            offset += count
        meta = inputs.attn_metadata
        assert inputs.input_ids.tolist() == ids and inputs.positions.tolist() == positions
        assert meta.slot_mapping.tolist() == slots
        assert inputs.sampling_req_ids == samplers and inputs.logits_indices.tolist() == logits_rows
        decodes = [states[rid] for rid in order if scheduled[rid] == 1]
        assert meta.num_decode_tokens == len(decodes)
        assert meta.decode_seq_lens.tolist() == [state.num_computed_tokens + 1 for state in decodes]
        for row, state in zip(meta.decode_block_tables.tolist(), decodes):
            used = state.num_computed_tokens // BLOCK_SIZE + 1
            assert row[:used] == state.block_ids[:used] and not any(row[used:])
        for chunk, request_id in zip(meta.prefills, [rid for rid in order if scheduled[rid] != 1]):
            state = states[request_id]
            assert chunk.seq_len == state.num_computed_tokens + scheduled[request_id]
            assert chunk.block_table.tolist() == state.block_ids[: -(-chunk.seq_len // BLOCK_SIZE)]
        with_prompt_logprobs = {piece.request_id for piece in inputs.prompt_logprobs}
        assert with_prompt_logprobs <= {rid for rid in order if states[rid].sampling_params.prompt_logprobs is not None}


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
            requests.add(RunnerRequestState(request_id, [1], 1, params, list(blocks), 0))
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
