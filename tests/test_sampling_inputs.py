"""The sampler's per-row inputs, built once for a run of steps over the same requests: each step must describe its
rows exactly as a description built afresh would, and draw keys must be DrawKeys.at's, row by row."""

import torch

from pagedserve.executor.input_batch import RunnerRequests, RunnerRequestState
from pagedserve.executor.sampling_inputs import SamplingInputs
from pagedserve.layers.sampling_rule import DrawKeys
from pagedserve.sampling_params import SamplingParams

PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.0, seed=11, top_p=0.9),
    SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[5], presence_penalty=0.5),
    SamplingParams(temperature=1.0, seed=12, logprobs=2, repetition_penalty=1.2),
    SamplingParams(temperature=0.5, min_p=0.1),
]


def _batch() -> tuple[RunnerRequests, list[str]]:
    requests = RunnerRequests()
    for index, params in enumerate(PARAMS):
        requests.add(RunnerRequestState(f"r{index}", [1, 2, 3] + [7] * index, 3, params, [index]), 2 + index)
    return requests, [f"r{index}" for index in range(len(PARAMS))]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is not None and b is not None and torch.equal(a, b)
    return a == b


def _assert_same_metadata(cached, fresh) -> None:
    for field in ("all_greedy", "token_ids", "num_prompt_tokens", "min_tokens_bans", "max_num_logprobs",
                  "presence_penalty", "frequency_penalty", "repetition_penalty"):
        assert _same(getattr(cached, field), getattr(fresh, field)), field
    for field in ("temperature", "top_k", "top_p", "min_p"):
        assert _same(getattr(cached.filters, field), getattr(fresh.filters, field)), field
    assert all(torch.equal(a, b) for a, b in zip(cached.draw_keys, fresh.draw_keys))


def test_a_run_of_steps_describes_its_rows_as_a_fresh_description_would():
    requests, ids = _batch()
    states = requests.of(ids)
    cached_inputs, fresh_inputs = SamplingInputs(torch.device("cpu"), DrawKeys(3)), SamplingInputs(torch.device("cpu"), DrawKeys(3))
    reference_keys = DrawKeys(3)
    for _ in range(5):
        cached = cached_inputs.metadata(states, batch_key=(requests.version, tuple(ids)))
        fresh = fresh_inputs.metadata(states)
        _assert_same_metadata(cached, fresh)
        expected = [reference_keys.at(state.sampling_params.seed, state.num_output_tokens) for state in states]
        assert list(zip(cached.draw_keys[0].tolist(), cached.draw_keys[1].tolist())) == expected
        # min_tokens: row 3 must not stop before its third output token, whatever the cache holds.
        assert [row for row, _ in cached.min_tokens_bans] == ([3] if states[3].num_output_tokens < 3 else [])
        for state in states:
            state.token_ids.append(9)
    assert not cached.min_tokens_bans


def test_a_request_replaced_under_the_same_id_is_described_by_its_own_parameters():
    requests, ids = _batch()
    inputs = SamplingInputs(torch.device("cpu"), DrawKeys(0))
    inputs.metadata(requests.of(ids), batch_key=(requests.version, tuple(ids)))
    requests.remove("r0")
    requests.add(RunnerRequestState("r0", [1, 2, 3], 3, SamplingParams(temperature=0.3, top_k=2), [0]), 2)
    metadata = inputs.metadata(requests.of(ids), batch_key=(requests.version, tuple(ids)))
    assert metadata.filters.temperature[0].item() == torch.tensor(0.3).item()
    assert metadata.filters.top_k[0].item() == 2
