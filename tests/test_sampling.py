"""Sampling parameters: seeds, top-k/top-p/min-p, penalties, stops, n, validation."""

import pytest
import torch
from conftest import PROMPTS, chi_square_p_value, greedy, hf_greedy, token_ids_of

from pagedserve import LLM, SamplingParams
from pagedserve.layers.sampling_rule import FilterColumns, filtered_distribution


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


def test_logit_bias_is_transformers_sequence_bias_of_single_tokens(tiny_models):
    """Each row's biases move the tokens they name, before the repetition penalty, as transformers' sequence_bias
    does for sequences of one token; rows without a bias in the same batch are untouched."""
    model_dir = tiny_models["llama"]
    prompts = [[1, 200, 300, 400], [1, 5000, 77, 9]]
    llm = LLM(str(model_dir), kv_cache_memory=64 * 1024**2)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    plain = token_ids_of(llm.generate(inputs, greedy(10), use_tqdm=False))
    for row in (0, 1):  # a ban, a push down, a boost and a bias on a token the output would not reach
        other = 1 - row
        bias = {plain[row][0]: -100.0, plain[row][1]: -2.5, plain[other][3]: 7.5, 1234: 3}
        params = [greedy(10), greedy(10)]
        params[row] = greedy(10, logit_bias=bias, repetition_penalty=1.3)
        ours = token_ids_of(llm.generate(inputs, params, use_tqdm=False))
        theirs = hf_greedy(model_dir, [prompts[row]], 10, repetition_penalty=1.3, sequence_bias={(t,): float(b) for t, b in bias.items()})
        assert ours[row] == theirs[0] and ours[row][0] != plain[row][0]
        assert ours[other] == plain[other]
    forced = llm.generate(inputs[0], greedy(4, logit_bias={4321: 100}), use_tqdm=False)[0].outputs[0].token_ids
    assert forced == [4321] * 4


def test_allowed_token_ids_keep_the_output_to_those_tokens(tiny_models):
    """Greedy: transformers' greedy over logits masked to the allowed tokens; sampled: every token one of them; a
    logit_bias on top moves the choice among them."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class KeepOnly(LogitsProcessor):
        def __init__(self, token_ids):
            self.token_ids = torch.tensor(token_ids)

        def __call__(self, input_ids, scores):
            kept = torch.full_like(scores, float("-inf"))
            kept[:, self.token_ids] = scores[:, self.token_ids]
            return kept

    model_dir = tiny_models["llama"]
    prompt = [1, 200, 300, 400]
    llm = LLM(str(model_dir), kv_cache_memory=64 * 1024**2)
    plain = llm.generate({"prompt_token_ids": prompt}, greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    allowed = [plain[1], plain[3], 777, 9000, 31000]
    ours = llm.generate({"prompt_token_ids": prompt}, greedy(8, allowed_token_ids=allowed), use_tqdm=False)[0].outputs[0].token_ids
    assert ours == hf_greedy(model_dir, [prompt], 8, logits_processor=LogitsProcessorList([KeepOnly(allowed)]))[0] != plain
    sampled = llm.generate({"prompt_token_ids": prompt}, sample(max_tokens=64, seed=3, allowed_token_ids=allowed), use_tqdm=False)
    assert set(sampled[0].outputs[0].token_ids) <= set(allowed) and len(set(sampled[0].outputs[0].token_ids)) > 1
    biased = llm.generate({"prompt_token_ids": prompt}, greedy(4, allowed_token_ids=allowed, logit_bias={9000: 100}), use_tqdm=False)
    assert biased[0].outputs[0].token_ids == [9000] * 4


def test_logit_bias_adds_to_a_copy_of_the_logits():
    from pagedserve.layers.sampler import Sampler, SamplingMetadata

    logits = torch.zeros(2, 5)
    rows, tokens, biases = torch.tensor([0, 0, 1]), torch.tensor([1, 4, 1]), torch.tensor([2.0, -100.0, 0.5])
    meta = SamplingMetadata(filters=FilterColumns(torch.zeros(2)), all_greedy=True, presence_penalty=None, frequency_penalty=None,
                            repetition_penalty=None, token_ids=[], num_prompt_tokens=[], min_tokens_bans=[], max_num_logprobs=None,
                            logit_bias=(rows, tokens, biases))
    out = Sampler().process_logits(logits, meta)
    assert out.tolist() == [[0, 2, 0, 0, -100], [0, 0.5, 0, 0, 0]]
    assert logits.eq(0).all()  # the raw logits stay for the logprobs


def test_token_ids_outside_the_vocabulary_are_refused(default_llm):
    with pytest.raises(ValueError, match="logit_bias must be keyed by token ids < vocab size 49152"):
        default_llm.generate("Hi", greedy(2, logit_bias={49152: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids must be token ids < vocab size 49152"):
        default_llm.generate("Hi", greedy(2, allowed_token_ids=[5, 49152]), use_tqdm=False)


def penalty_metadata(presence, frequency, repetition, token_ids, num_prompt_tokens):
    from pagedserve.layers.sampler import SamplingMetadata

    rows = len(token_ids)
    return SamplingMetadata(
        filters=FilterColumns(torch.zeros(rows)), all_greedy=True,
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


def distribution(probabilities, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    logits = torch.log(torch.tensor([probabilities], dtype=torch.float64))
    columns = FilterColumns(torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))
    return filtered_distribution(logits, columns)[0].tolist()


def test_the_filters_keep_what_the_api_says():
    """Worked by hand: top-k keeps the k most likely (and any tied with the k-th), top-p the smallest set of the most
    likely that reaches p, min-p the tokens at least min_p times as likely as the most likely one."""
    p = [0.5, 0.3, 0.15, 0.05]
    assert distribution(p, top_k=2) == pytest.approx([0.625, 0.375, 0, 0])
    assert distribution(p, top_p=0.7) == pytest.approx([0.625, 0.375, 0, 0])  # 0.5 alone falls short of 0.7
    assert distribution(p, top_p=0.5) == pytest.approx([1, 0, 0, 0])  # 0.5 reaches it
    assert distribution(p, top_k=0, top_p=1.0) == pytest.approx(p)
    assert distribution(p, min_p=0.25) == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    assert distribution(p, temperature=0.5) == pytest.approx([x * x / sum(y * y for y in p) for x in p])
    tied = [0.4, 0.2, 0.2, 0.2]
    assert distribution(tied, top_k=2) == pytest.approx(tied)  # all tied with the 2nd stay
    assert distribution(tied, top_p=0.5) == pytest.approx(tied)  # each 0.2 has only 0.4 strictly above it


def test_top_p_of_one_keeps_every_kept_token_as_the_draw_does():
    """top_p 1 is off, in the distribution as in the kernel's draw: a token far lighter than the rest stays, where the
    kept tokens heavier than it weigh all of the total to float64's precision; rows of other top_p in the same batch
    get their own sets."""
    logits = torch.tensor([[0.0, -80.0, -1.0], [0.0, -80.0, -1.0]], dtype=torch.float64)
    columns = FilterColumns(torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), torch.tensor([1.0, 0.5]), torch.tensor([0.0, 0.0]))
    both = filtered_distribution(logits, columns)
    assert both[0, 1] > 0 and both[0].sum() == pytest.approx(1.0)
    assert both[1].tolist() == [1.0, 0.0, 0.0]  # the heaviest token alone holds half of the weight
    for row in range(2):
        alone = FilterColumns(columns.temperature[row:row + 1], columns.top_k[row:row + 1], columns.top_p[row:row + 1],
                              columns.min_p[row:row + 1])
        assert torch.equal(filtered_distribution(logits[row:row + 1], alone)[0], both[row])


@pytest.mark.parametrize("seed", range(6))
def test_a_top_p_set_found_among_the_heaviest_tokens_is_the_one_a_sort_of_the_vocabulary_finds(seed, monkeypatch):
    """Rows of peaked and flat weights, with ties (rounded logits), at top_p from tiny to near 1: the set found among a
    row's heaviest tokens (doubled as needed) equals the one found with the whole vocabulary sorted."""
    from pagedserve.layers import sampling_rule

    generator = torch.Generator().manual_seed(seed)
    scales = torch.tensor([0.3, 1.0, 3.0, 8.0])[:, None]
    logits = (torch.randn(4, 3000, generator=generator, dtype=torch.float64) * scales * 4).round() / 4
    kept = torch.exp(logits - logits.max(dim=-1, keepdim=True).values)
    for top_p in (0.01, 0.3, 0.9, 0.999):
        column = torch.full((4,), top_p)
        found = sampling_rule.top_p_sets(kept, column)
        with monkeypatch.context() as patch:
            patch.setattr(sampling_rule, "FIRST_HEAVIEST", kept.shape[-1])
            assert torch.equal(found, sampling_rule.top_p_sets(kept, column))
        assert found.any(dim=-1).all()  # the heaviest token is always in its set


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
        ("logit_bias", {7: 100.5}, "logit_bias must be a number in \\[-100, 100\\] for each token, got \\{7: 100.5\\}"),
        ("logit_bias", {-1: 1.0}, "logit_bias must be keyed by non-negative token ids"),
        ("logit_bias", {"7": 1.0}, "logit_bias must be keyed by non-negative token ids"),
        ("allowed_token_ids", [], "allowed_token_ids must be a non-empty list of non-negative token ids"),
        ("allowed_token_ids", [3, -1], "allowed_token_ids must be a non-empty list of non-negative token ids"),
    ],
)
def test_invalid_parameters_name_the_field_and_range(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def reference_probabilities(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The filtered distribution (layers/sampling_rule.py): what every draw must follow."""
    columns = FilterColumns(torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))
    return filtered_distribution(logits[None].double(), columns)[0]


FILTERS = [  # (temperature, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.3, 5, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.2),
    (0.9, 8, 0.9, 0.05), (2.0, 0, 0.5, 0.0),
    (1.0, 1000, 1.0, 0.0), (1.0, 0, 0.999, 0.0),  # a large top-k; a top-p set of most of the vocabulary
]


@pytest.mark.parametrize("vocab", [24, 3000])  # 3000: a long tail of tiny weights, as a real vocabulary has
@pytest.mark.parametrize("temperature,top_k,top_p,min_p", FILTERS)
def test_kernel_draws_follow_the_filtered_distribution(vocab, temperature, top_k, top_p, min_p):
    """Many draws of one row against the filtered distribution (chi-square at a fixed seed); the same
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


@pytest.mark.parametrize("vocab", [24, 3000, 49152])
@pytest.mark.parametrize("temperature,top_k,top_p,min_p", FILTERS)
def test_the_torch_path_draws_the_kernels_tokens(vocab, temperature, top_k, top_p, min_p):
    """One draw rule: for the same logits, filters and keys, the torch path (no C++ kernels built, or another device)
    draws token for token what the kernel draws, and a row's token does not depend on the rows beside it."""
    from pagedserve.layers import cpu_kernels
    from pagedserve.layers.sampling_rule import sample

    rows = 64
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)) * 4
    full = lambda value, dtype=torch.float32: torch.full((rows,), value, dtype=dtype)  # noqa: E731
    columns = FilterColumns(full(temperature), full(top_k, torch.long), full(top_p), full(min_p))
    keys, counters = torch.arange(rows) * 7919 - 3, torch.arange(rows) + 11
    kernel = sample(logits, columns, keys, counters, cpu_kernels.load())
    assert torch.equal(sample(logits, columns, keys, counters, None), kernel)
    reversed_rows = torch.arange(rows - 1, -1, -1)
    reversed_columns = FilterColumns(*(getattr(columns, name)[reversed_rows] for name in ("temperature", "top_k", "top_p", "min_p")))
    alone = sample(logits[reversed_rows], reversed_columns, keys[reversed_rows], counters[reversed_rows], None)
    assert torch.equal(alone, kernel[reversed_rows])


@pytest.mark.slow
def test_a_seeded_request_samples_the_same_tokens_with_or_without_the_kernels(default_llm):
    """A user's seeded request gives the same text whether or not the C++ kernels are built (cpu_kernels off: every
    layer and the sampler on their torch paths, the GEMMs on dequantized weights)."""
    params = [sample(seed=seed, temperature=0.8, top_p=0.95, top_k=50, max_tokens=12) for seed in (1, 2, 3)]
    with_kernels = token_ids_of(default_llm.generate(PROMPTS[:3], params, use_tqdm=False))
    plain = LLM(max_model_len=512, kv_cache_memory=64 * 1024**2, cpu_kernels=False, attention_backend="torch")
    assert token_ids_of(plain.generate(PROMPTS[:3], params, use_tqdm=False)) == with_kernels
