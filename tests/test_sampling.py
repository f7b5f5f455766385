"""Sampling parameters: seeds, top-k/top-p/min-p, penalties, stops, n, validation."""

import pytest
import torch
from conftest import PROMPTS, chi_square_p_value, greedy, token_ids_of

from pagedserve import SamplingParams
from pagedserve.layers.sampler import apply_min_p, apply_top_k_top_p


def sample(temperature=1.0, max_tokens=16, **kwargs):
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def test_same_seed_same_output_whatever_else_is_in_the_batch(default_llm):
    params = sample(seed=1234, top_p=0.95)
    alone = default_llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids
    again = default_llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids
    crowd = default_llm.generate(PROMPTS[1:] + [PROMPTS[0]] + PROMPTS[1:], [sample()] * 3 + [params] + [sample()] * 3,
                                 use_tqdm=False)
    assert alone == again == crowd[3].outputs[0].token_ids
    other_seed = default_llm.generate(PROMPTS[0], sample(seed=99, top_p=0.95), use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def test_top_k_1_equals_greedy(default_llm):
    greedy_ids = token_ids_of(default_llm.generate(PROMPTS, greedy(16), use_tqdm=False))
    top1_ids = token_ids_of(default_llm.generate(PROMPTS, sample(top_k=1, temperature=1.5), use_tqdm=False))
    assert top1_ids == greedy_ids


def test_n_samples_are_distinct_and_reproducible_with_a_seed(default_llm):
    params = sample(n=3, seed=7, temperature=1.2)
    first = default_llm.generate(PROMPTS[2], params, use_tqdm=False)[0]
    second = default_llm.generate(PROMPTS[2], params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3


def test_stop_string_spanning_tokens_is_cut_from_the_text(default_llm, tokenizer):
    full = default_llm.generate(PROMPTS[2], greedy(40), use_tqdm=False)[0].outputs[0]
    pieces = [tokenizer.decode([t]) for t in full.token_ids]
    # A stop string made of the end of token 5 and the start of token 6 spans two tokens.
    stop = pieces[5][-2:] + pieces[6][:2]
    assert len(stop) >= 3
    position = full.text.find(stop)
    out = default_llm.generate(PROMPTS[2], greedy(40, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[:position]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == full.token_ids[: len(out.token_ids)] and len(out.token_ids) <= 7
    kept = default_llm.generate(PROMPTS[2], greedy(40, stop=[stop], include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.outputs[0].text == full.text[: position + len(stop)]


def test_stop_token_ids_and_min_tokens(default_llm, tokenizer):
    full = default_llm.generate(PROMPTS[1], greedy(20), use_tqdm=False)[0].outputs[0].token_ids
    stop_id = full[3]
    first_index = full.index(stop_id)
    out = default_llm.generate(PROMPTS[1], greedy(20, stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full[: first_index + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.text == tokenizer.decode(full[:first_index], skip_special_tokens=True)
    late = default_llm.generate(PROMPTS[1], greedy(20, stop_token_ids=[stop_id], min_tokens=first_index + 2), use_tqdm=False)
    assert len(late[0].outputs[0].token_ids) >= first_index + 2
    assert stop_id not in late[0].outputs[0].token_ids[: first_index + 1]


def test_eos_stops_unless_ignored(default_llm):
    chat = [{"role": "user", "content": "Say the single word: yes"}]
    stopped = default_llm.chat(chat, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None and len(stopped.token_ids) < 64
    ignored = default_llm.chat(chat, SamplingParams(temperature=0, max_tokens=len(stopped.token_ids) + 3, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == len(stopped.token_ids) + 3


def test_repetition_penalty_changes_a_repetitive_greedy_output(default_llm):
    prompt = "one one one one one one one one"
    plain = default_llm.generate(prompt, greedy(12), use_tqdm=False)[0].outputs[0].token_ids
    penalized = default_llm.generate(prompt, greedy(12, repetition_penalty=2.0), use_tqdm=False)[0].outputs[0].token_ids
    assert plain != penalized
    assert penalized.count(plain[0]) < plain.count(plain[0])


def penalty_metadata(presence, frequency, repetition, token_ids, num_prompt_tokens):
    from pagedserve.layers.sampler import SamplingMetadata

    rows = len(token_ids)
    return SamplingMetadata(
        temperature=torch.zeros(rows), all_greedy=True, top_k=None, top_p=None, min_p=None,
        presence_penalty=torch.tensor(presence), frequency_penalty=torch.tensor(frequency), repetition_penalty=torch.tensor(repetition),
        token_ids=token_ids, num_prompt_tokens=num_prompt_tokens, min_tokens_bans=[], max_num_logprobs=None,
    )


@pytest.mark.parametrize("with_kernels", [False, True])
def test_penalty_arithmetic(with_kernels):
    from pagedserve.layers import cpu_kernels
    from pagedserve.layers.sampler import apply_penalties

    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    meta = penalty_metadata([0.5], [0.25], [2.0], token_ids=[[2, 0, 0, 1]], num_prompt_tokens=[1])
    out = apply_penalties(logits, meta, cpu_kernels.load() if with_kernels else None)
    # token 0: 2/2 - 0.25*2 - 0.5; token 1: -1*2 - 0.25 - 0.5; token 2 (prompt only): 0.5/2; token 3 untouched
    assert out[0].tolist() == pytest.approx([0.0, -2.75, 0.25, 1.0])


def test_penalty_kernel_matches_the_torch_path():
    import random

    from pagedserve.layers import cpu_kernels
    from pagedserve.layers.sampler import apply_penalties

    rng = random.Random(0)
    rows, vocab = 6, 300
    token_ids = [[rng.randrange(vocab) for _ in range(rng.randint(0, 40))] for _ in range(rows)]
    prompts = [rng.randint(0, len(t)) for t in token_ids]
    meta = penalty_metadata([rng.uniform(-2, 2) for _ in range(rows)], [rng.uniform(-2, 2) for _ in range(rows)],
                            [rng.uniform(0.5, 2) for _ in range(rows)], token_ids, prompts)
    logits = torch.randn(rows, vocab) * 3
    expected = apply_penalties(logits.clone(), meta)
    torch.testing.assert_close(apply_penalties(logits.clone(), meta, cpu_kernels.load()), expected)


def test_top_k_top_p_min_p_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda x: torch.isfinite(x[0]).tolist()  # noqa: E731
    assert kept(apply_top_k_top_p(logits, torch.tensor([2]), None)) == [True, True, False, False]
    assert kept(apply_top_k_top_p(logits, None, torch.tensor([0.7]))) == [True, True, False, False]
    assert kept(apply_top_k_top_p(logits, None, torch.tensor([0.5]))) == [True, False, False, False]
    assert kept(apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([1.0]))) == [True] * 4
    assert kept(apply_min_p(logits, torch.tensor([0.25]))) == [True, True, True, False]


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("temperature", -0.1, "temperature must be >= 0"),
        ("top_p", 0.0, "top_p must be in \\(0, 1\\]"),
        ("top_k", -2, "top_k must be"),
        ("min_p", 1.5, "min_p must be in \\[0, 1\\]"),
        ("presence_penalty", 3.0, "presence_penalty must be in \\[-2, 2\\]"),
        ("frequency_penalty", -2.5, "frequency_penalty must be in \\[-2, 2\\]"),
        ("repetition_penalty", 0.0, "repetition_penalty must be in \\(0, 2\\]"),
        ("max_tokens", 0, "max_tokens must be an integer >= 1"),
        ("n", 0, "n must be an integer >= 1"),
        ("logprobs", 21, "logprobs must be an integer in \\[0, 20\\]"),
        ("prompt_logprobs", -1, "prompt_logprobs must be"),
        ("min_tokens", -1, "min_tokens must be"),
        ("stop", [""], "stop must be non-empty strings"),
    ],
)
def test_invalid_parameters_name_the_field_and_range(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def reference_probabilities(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The target distribution, by the torch path's filters: what every draw must follow."""
    scaled = logits[None] / temperature
    if min_p > 0:
        scaled = apply_min_p(scaled, torch.tensor([min_p]))
    scaled = apply_top_k_top_p(scaled, torch.tensor([top_k]), torch.tensor([top_p]))
    return torch.softmax(scaled, dim=-1)[0].double()


FILTERS = [  # (temperature, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.3, 5, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.2),
    (0.9, 8, 0.9, 0.05), (2.0, 0, 0.5, 0.0),
    (1.0, 1000, 1.0, 0.0), (1.0, 0, 0.999, 0.0),  # a large top-k; a top-p set of most of the vocabulary
]


@pytest.mark.parametrize("vocab", [24, 3000])  # 3000: a long tail of tiny weights, as a real vocabulary has
@pytest.mark.parametrize("temperature,top_k,top_p,min_p", FILTERS)
def test_kernel_draws_follow_the_filtered_distribution(vocab, temperature, top_k, top_p, min_p):
    """Many draws of one row against the torch path's distribution (chi-square at a fixed seed); the same
    test rejects the draws when the distribution they are held to is off by a little (temperature +10%)."""
    from pagedserve.layers import cpu_kernels

    kernels = cpu_kernels.load()
    torch.manual_seed(vocab)
    logits = torch.randn(vocab) * (4.0 if vocab > 100 else 1.5)
    draws = 40_000
    rows = logits.expand(draws, vocab).contiguous()
    column = lambda value, dtype=torch.float32: torch.full((draws,), value, dtype=dtype)  # noqa: E731
    tokens = kernels.sample_rows(rows, column(temperature), column(top_k, torch.long), column(top_p), column(min_p),
                                 column(12345, torch.long), torch.arange(draws))
    counts = torch.bincount(tokens, minlength=vocab).double()
    expected = reference_probabilities(logits, temperature, top_k, top_p, min_p)
    assert counts[expected == 0].sum() == 0, "drew a token the filters remove"
    assert chi_square_p_value(counts, expected) > 1e-4
    biased = reference_probabilities(logits, temperature * 1.1, top_k, top_p, min_p)
    assert chi_square_p_value(counts, biased) < 1e-4


def test_kernel_draws_are_keyed_by_seed_and_position_and_greedy_rows_take_argmax():
    from pagedserve.layers import cpu_kernels

    kernels = cpu_kernels.load()
    logits = torch.randn(4, 500)
    temperature, top_k = torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.zeros(4, dtype=torch.long)
    top_p, min_p = torch.ones(4), torch.zeros(4)
    first = kernels.sample_rows(logits, temperature, top_k, top_p, min_p, torch.tensor([7, 7, 7, 8]), torch.tensor([3, 3, 3, 3]))
    again = kernels.sample_rows(logits, temperature, top_k, top_p, min_p, torch.tensor([7, 7, 7, 8]), torch.tensor([3, 3, 3, 3]))
    assert torch.equal(first, again)
    assert first[2] == logits[2].argmax()
    swapped = kernels.sample_rows(logits[[1, 0]].contiguous(), temperature[:2], top_k[:2], top_p[:2], min_p[:2],
                                  torch.tensor([7, 7]), torch.tensor([3, 3]))
    assert torch.equal(swapped, first[[1, 0]])  # a row's draw depends on its key and position, not its place in the batch
