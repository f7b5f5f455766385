"""Speculative decoding: greedy outputs identical to decoding without it, sampled outputs distributed as the
target model's, and speculation that does not pay switching itself off."""

from __future__ import annotations

import json
import random
import shutil
import time

import numpy as np
import pytest
import torch
from conftest import PROMPTS, TOKENIZER_FILES, chi_square_p_value, engine_core_of, greedy, token_ids_of
from scheduler_harness import make_request, make_scheduler

from pagedserve import LLM, SamplingParams
from pagedserve.benchmarks.datasets import passages
from pagedserve.config import EngineConfig, SpeculativeConfig
from pagedserve.core.contracts import ModelRunnerOutput, SchedulerStats, SpecDecodingStats
from pagedserve.engine.metrics import EngineMetrics
from pagedserve.layers.sampling_rule import RESIDUAL_STREAM, FilterColumns, philox_uniform, sample
from pagedserve.spec_decode import rejection_sampler
from pagedserve.spec_decode.ngram_proposer import NgramProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
MAX_TOKENS = 40


def copy_prompts():
    """Prompts whose answers copy text from them: where prompt lookup drafts well."""
    texts = passages()[:3]
    return [f"Repeat the following text word for word.\n\n{texts[0][:400]}\n\nRepeated text:\n{texts[0][:60]}",
            f"{texts[1][:300]}\n\nNow the same text again:\n{texts[1][:40]}",
            "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7,"]


@pytest.fixture(scope="module")
def ngram_llm(default_model_dir):
    return LLM(str(default_model_dir), max_model_len=2048, kv_cache_memory=256 * 1024**2, speculative_config=NGRAM)


def spec_stats(llm) -> SpecDecodingStats:
    return engine_core_of(llm).get_stats().spec


def test_ngram_greedy_outputs_equal_decoding_without_speculation(ngram_llm, default_llm):
    prompts = copy_prompts() + PROMPTS
    before = spec_stats(ngram_llm).num_accepted_tokens
    expected = token_ids_of(default_llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False))
    assert token_ids_of(ngram_llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)) == expected
    assert spec_stats(ngram_llm).num_accepted_tokens - before > MAX_TOKENS  # the copying prompts did speculate


def test_stop_strings_eos_and_max_tokens_inside_a_draft(ngram_llm, default_llm):
    """Whatever ends a request inside a run of accepted drafts ends it there: nothing after it is output."""
    text = passages()[2][:200]
    conversation = [{"role": "user", "content": f"Repeat this sentence exactly, then stop: {text.split('.')[0]}."}]
    cases = [
        (conversation, SamplingParams(temperature=0, max_tokens=120)),  # ends at EOS (<|im_end|> is in the chat prompt too)
        (conversation, SamplingParams(temperature=0, max_tokens=120, stop=[text.split()[6]])),  # a word from the middle
        (conversation, SamplingParams(temperature=0, max_tokens=13)),
        (conversation, SamplingParams(temperature=0, max_tokens=120, stop_token_ids=[13], min_tokens=5, logprobs=2)),
    ]
    for messages, params in cases:
        want = default_llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
        got = ngram_llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
            want.text, want.token_ids, want.finish_reason, want.stop_reason), params
        if params.logprobs:
            assert len(got.logprobs) == len(got.token_ids)
            for got_position, want_position in zip(got.logprobs, want.logprobs):
                assert list(got_position) == list(want_position)
                assert [p.logprob for p in got_position.values()] == pytest.approx([p.logprob for p in want_position.values()], abs=2e-3)
            assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-2)


def test_logit_bias_and_penalties_on_drafts_equal_decoding_without_speculation(ngram_llm, default_llm):
    """Drafts are verified against the logits as sampling would see them (masked, biased, penalized), and the logprobs
    returned are the model's raw ones either way."""
    prompt = copy_prompts()[0]
    plain = default_llm.generate(prompt, greedy(MAX_TOKENS), use_tqdm=False)[0].outputs[0].token_ids
    bias = {plain[5]: -100.0, plain[20]: -1.5}
    allowed = sorted(set(plain) - {plain[7]})
    for options in ({"logit_bias": bias}, {"repetition_penalty": 1.1}, {"logit_bias": bias, "repetition_penalty": 1.1},
                    {"allowed_token_ids": allowed}):
        before = spec_stats(ngram_llm).num_accepted_tokens
        params = greedy(MAX_TOKENS, logprobs=2, **options)
        want = default_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        got = ngram_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == want.token_ids, options
        assert plain[5] not in want.token_ids[:6] or "logit_bias" not in options
        assert set(want.token_ids) <= set(allowed) or "allowed_token_ids" not in options
        for got_position, want_position in zip(got.logprobs, want.logprobs):
            assert list(got_position) == list(want_position), options
            assert [p.logprob for p in got_position.values()] == pytest.approx([p.logprob for p in want_position.values()], abs=2e-3)
        assert spec_stats(ngram_llm).num_accepted_tokens > before  # drafts were verified


@pytest.mark.slow
def test_ngram_with_chunked_prefill_prefix_caching_and_preemption(default_model_dir, default_llm):
    prompts = copy_prompts() * 2 + PROMPTS  # repeats hit the prefix cache
    expected = token_ids_of(default_llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False))
    # 24 blocks of 16 tokens for 10 requests of up to ~200 tokens: they preempt each other.
    llm = LLM(str(default_model_dir), max_model_len=384, num_gpu_blocks_override=24, max_num_batched_tokens=48,
              long_prefill_token_threshold=32, enable_prefix_caching=True, speculative_config=NGRAM)
    assert token_ids_of(llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)) == expected
    stats = engine_core_of(llm).get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.spec.num_accepted_tokens > 0


# ---- draft model --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def draft_models(tiny_models, tmp_path_factory):
    """(target, a draft that mostly agrees with it: its weights plus noise, a draft with another vocabulary size)."""
    from transformers import AutoModelForCausalLM

    target = tiny_models["llama"]
    root = tmp_path_factory.mktemp("drafts")
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * parameter.std() * 0.1)
    model.save_pretrained(root / "noisy")
    for name in TOKENIZER_FILES:
        if (target / name).exists():
            shutil.copy(target / name, root / "noisy" / name)
    other_vocab = root / "other_vocab"
    shutil.copytree(root / "noisy", other_vocab)
    config = json.loads((other_vocab / "config.json").read_text())
    config["vocab_size"] = 32000
    (other_vocab / "config.json").write_text(json.dumps(config))
    return target, root / "noisy", other_vocab


def tiny_prompts(count=6, seed=5):
    rng = random.Random(seed)
    # Repetitive token prompts, so that an n-gram or a weak draft is sometimes right.
    return [{"prompt_token_ids": [rng.randrange(100, 2000) for _ in range(rng.randint(3, 8))] * rng.randint(2, 6)} for _ in range(count)]


@pytest.mark.parametrize("draft", ["target", "noisy"])
def test_draft_model_greedy_outputs_equal_decoding_without_speculation(draft_models, draft):
    target, noisy, _ = draft_models
    draft_dir = target if draft == "target" else noisy
    prompts = tiny_prompts()
    plain = LLM(str(target), kv_cache_memory=32 * 1024**2)
    expected = token_ids_of(plain.generate(prompts, greedy(30), use_tqdm=False))
    # Small budgets: chunked prompts, preemptions and lookahead slots that run out.
    llm = LLM(str(target), num_gpu_blocks_override=10, max_model_len=128, max_num_batched_tokens=24, enable_prefix_caching=True,
              speculative_config={"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3})
    assert token_ids_of(llm.generate(prompts, greedy(30), use_tqdm=False)) == expected
    stats = engine_core_of(llm).get_stats()
    assert stats.num_preemptions > 0
    if draft == "target":  # the target drafting for itself is always right
        assert stats.spec.num_accepted_tokens == stats.spec.num_draft_tokens > 0
    else:
        assert 0 < stats.spec.num_accepted_tokens < stats.spec.num_draft_tokens


@pytest.mark.parametrize("draft", ["target", "noisy"])
def test_speculation_over_an_8_bit_cache_equals_decoding_without_it(draft_models, draft):
    """A verification writes its drafts' rows quantized and reads them back as a decode would, a rejected draft's rows
    are written over, and the draft model keeps an 8-bit cache of its own: the tokens of decoding without speculation
    on the same cache, whether every draft is accepted or some."""
    target, noisy, _ = draft_models
    prompts = tiny_prompts()
    plain = LLM(str(target), kv_cache_memory=32 * 1024**2, kv_cache_dtype="fp8")
    expected = token_ids_of(plain.generate(prompts, greedy(30), use_tqdm=False))
    spec = {"method": "draft_model", "model": str(target if draft == "target" else noisy), "num_speculative_tokens": 3}
    llm = LLM(str(target), kv_cache_memory=32 * 1024**2, kv_cache_dtype="fp8", speculative_config=spec)
    assert token_ids_of(llm.generate(prompts, greedy(30), use_tqdm=False)) == expected
    stats = engine_core_of(llm).get_stats().spec
    assert stats.num_draft_tokens > 0 and (stats.num_accepted_tokens == stats.num_draft_tokens) == (draft == "target")


def test_draft_model_must_share_the_vocabulary(draft_models):
    target, _, other_vocab = draft_models
    with pytest.raises(ValueError, match="speculative_config.model must share the target's vocabulary"):
        LLM(str(target), kv_cache_memory=32 * 1024**2,
            speculative_config={"method": "draft_model", "model": str(other_vocab), "num_speculative_tokens": 3})


# ---- the distribution ---------------------------------------------------------------------------------


def _verify_many(p: torch.Tensor, q: torch.Tensor | None, trials: int, seed: int) -> np.ndarray:
    """Counts of the first token a verification outputs, drafting from q (None: always token 0)."""
    rng = np.random.Generator(np.random.Philox(seed))
    logits = torch.log(p).repeat(2, 1)  # position 0 scores the draft; position 1 is the bonus token's
    params = SamplingParams(temperature=1.0)
    counts = np.zeros(len(p), dtype=np.int64)
    for trial in range(trials):
        draft = 0 if q is None else int(rng.choice(len(q), p=q.numpy()))
        keys = [(seed, 2 * trial), (seed, 2 * trial + 1)]
        result = rejection_sampler.verify(logits, [draft], params, keys, None if q is None else q.unsqueeze(0).double())
        counts[result.accepted[0] if result.accepted else result.token_id] += 1
    return counts


TARGET = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.02, 0.08, 0.15, 0.05], dtype=torch.float64)
DRAFT = torch.tensor([0.30, 0.05, 0.20, 0.05, 0.20, 0.05, 0.10, 0.05], dtype=torch.float64)


@pytest.mark.parametrize("with_kernels", [False, True])
@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [(1.0, 0, 1.0, 0.0), (0.9, 8, 0.9, 0.05), (1.2, 3000, 0.95, 0.0)])
def test_a_verification_that_accepts_every_draft_draws_the_next_token_as_sampling_would(temperature, top_k, top_p, min_p,
                                                                                          with_kernels):
    """The same draw rule with speculation on or off: drafts the target is sure of are accepted, and the token after
    them is the one the sampler draws from the same logits at the same position and seed."""
    from pagedserve.layers import cpu_kernels

    kernels = cpu_kernels.load() if with_kernels else None
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=77)
    for trial in range(20):
        logits = torch.randn(4, 5000, generator=torch.Generator().manual_seed(trial)) * 4
        drafts = [11, 12, 13]
        for position, draft in enumerate(drafts):
            logits[position, draft] = 1e4  # the target's certain choice
        keys = [(77, 30 + position) for position in range(4)]
        result = rejection_sampler.verify(logits, drafts, params, keys, None, kernels)
        columns = FilterColumns(torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))
        sampled = sample(logits[3:].contiguous(), columns, torch.tensor([77]), torch.tensor([33]), kernels)
        assert result.accepted == drafts and result.token_id == int(sampled[0])


@pytest.mark.parametrize("q", [DRAFT, None], ids=["draft-model", "point-mass"])
def test_rejection_sampling_outputs_the_target_distribution(q):
    counts = _verify_many(TARGET, q, 5000, seed=11)
    assert chi_square_p_value(torch.from_numpy(counts), TARGET) > 1e-3


@pytest.mark.parametrize("q", [DRAFT, None], ids=["draft-model", "point-mass"])
def test_the_chi_square_check_catches_a_wrong_residual(q, monkeypatch):
    """The same check fails when a rejection resamples from p instead of the normalized (p - q)+."""
    real_verify = rejection_sampler.verify

    def residual_from_p(logits, drafts, params, draw_keys, draft_probs=None, cpu_kernels=None):
        result = real_verify(logits, drafts, params, draw_keys, draft_probs, cpu_kernels)
        if not result.accepted:
            uniform = philox_uniform(*draw_keys[0], RESIDUAL_STREAM)
            result.token_id = rejection_sampler.draw(torch.softmax(logits[0].double(), dim=-1), uniform)
        return result

    monkeypatch.setattr(rejection_sampler, "verify", residual_from_p)
    counts = _verify_many(TARGET, q, 5000, seed=11)
    assert chi_square_p_value(torch.from_numpy(counts), TARGET) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_token_pairs_follow_the_target_model(draft_models, method):
    """Two sampled tokens under top-k 3 (9 possible pairs): their frequencies with speculation against the target's
    probabilities, computed by transformers."""
    from transformers import AutoModelForCausalLM

    target, noisy, _ = draft_models
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()

    def top3(ids):
        with torch.inference_mode():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        values, tokens = logits.topk(3)
        return dict(zip(tokens.tolist(), torch.softmax(values.double(), dim=-1).tolist()))

    # A prompt holding each of its likely first tokens, so that prompt lookup drafts a second token after any.
    base, seen = [400, 401, 402, 403] * 3, []
    prompt = base
    for _ in range(30):
        if set(top3(prompt)) <= set(prompt):
            break
        seen += [first for first in top3(prompt) if first not in seen]
        prompt = [token for first in seen for token in (first, 500)] + base
    assert set(top3(prompt)) <= set(prompt)
    expected = {(a, b): pa * pb for a, pa in top3(prompt).items() for b, pb in top3(prompt + [a]).items()}
    spec = ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2} if method == "ngram"
            else {"method": "draft_model", "model": str(noisy), "num_speculative_tokens": 2})
    llm = LLM(str(target), kv_cache_memory=64 * 1024**2, max_num_seqs=64, speculative_config=spec)
    samples = 3000
    outputs = llm.generate([{"prompt_token_ids": prompt}] * samples, SamplingParams(temperature=1.0, top_k=3, max_tokens=3,
                                                                                    ignore_eos=True), use_tqdm=False)
    assert engine_core_of(llm).get_stats().spec.num_drafts > samples / 2  # most second tokens went through a verification
    pairs = [tuple(o.outputs[0].token_ids[:2]) for o in outputs]
    cells = sorted(expected)
    assert set(pairs) <= set(cells)
    observed = torch.tensor([pairs.count(cell) for cell in cells])
    assert chi_square_p_value(observed, torch.tensor([expected[cell] for cell in cells], dtype=torch.float64)) > 1e-3


# ---- when speculation does not pay ----------------------------------------------------------------------


def _run_steps(scheduler, steps, accept):
    """Steps with a fake runner that drafts 3 tokens for every request asked and accepts `accept` of them."""
    proposed_for = []
    for _ in range(steps):
        output = scheduler.schedule()
        proposed_for.append(set(output.propose_for))
        runner = ModelRunnerOutput(sampled_token_ids={})
        for request_id in output.num_scheduled_tokens:
            request = scheduler.requests[request_id]
            if request.num_computed_tokens >= request.num_tokens:
                runner.sampled_token_ids[request_id] = 7
                drafts = output.drafts_to_verify.get(request_id, [])
                runner.accepted_token_ids[request_id] = drafts[:accept]
                if request_id in output.propose_for:
                    runner.proposed_drafts[request_id] = [7, 7, 7]
        scheduler.update_from_output(output, runner)
    return proposed_for


def test_a_request_whose_drafts_are_rejected_stops_drafting_for_a_while():
    scheduler = make_scheduler(speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3, min_acceptance_rate=0.3))
    scheduler.add_request(make_request("r", prompt_len=8, max_tokens=200))
    proposed_for = _run_steps(scheduler, 200, accept=0)
    paused = [i for i, ids in enumerate(proposed_for) if not ids]
    assert paused and paused[0] < 6  # off after a few rejected drafts
    resumed = [i for i in range(paused[0], 200) if proposed_for[i]]
    assert resumed, "it drafts again later"
    # Each pause in a row lasts longer: the gaps between drafting grow.
    gaps = [b - a for a, b in zip(resumed, resumed[1:]) if b - a > 1]
    assert len(gaps) >= 2 and gaps == sorted(gaps) and gaps[-1] > gaps[0]
    rate = scheduler.drafts.stats.num_accepted_tokens / scheduler.drafts.stats.num_draft_tokens
    assert rate == 0 and scheduler.drafts.stats.num_drafts < 20  # far fewer verifications than steps


def test_accepted_drafts_keep_drafting_and_a_large_batch_turns_it_off():
    scheduler = make_scheduler(speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3, disable_by_batch_size=3))
    scheduler.add_request(make_request("a", prompt_len=8, max_tokens=100))
    assert all(_run_steps(scheduler, 10, accept=3)[1:])
    assert scheduler.drafts.stats.num_accepted_tokens == scheduler.drafts.stats.num_draft_tokens > 0
    for name in ("b", "c"):
        scheduler.add_request(make_request(name, prompt_len=8, max_tokens=100))
    assert not any(_run_steps(scheduler, 5, accept=3)[1:])


# ---- settings and metrics -----------------------------------------------------------------------------


@pytest.mark.parametrize("values, field", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "speculative_config.prompt_lookup_max"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown field"),
    ({"num_speculative_tokens": 2}, "needs method"),
    ("{not json", "must be a JSON object"),
])
def test_bad_speculative_config_names_the_field(values, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative_config=values)


def test_ngram_lookup_takes_the_latest_longest_match():
    proposer = NgramProposer(3, 1, 3)
    assert proposer.lookup([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3]) == [8, 5, 1]  # the latest of two 3-gram matches
    assert proposer.lookup([4, 5, 6, 7]) == []
    assert proposer.lookup([7, 1, 9, 7]) == [1, 9, 7]


def test_metrics_count_drafts_and_accepted_tokens_per_position(caplog):
    metrics = EngineMetrics("m")
    metrics.record_outputs([], SchedulerStats(spec=SpecDecodingStats(2, 6, 4, [2, 1, 1])), now=0.0)
    metrics.record_outputs([], SchedulerStats(spec=SpecDecodingStats(3, 9, 5, [3, 1, 1])), now=1.0)
    text = __import__("prometheus_client").generate_latest(metrics.registry).decode()
    assert 'pagedserve:spec_decode_num_drafts_total{engine="0",model_name="m"} 3.0' in text
    assert 'pagedserve:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 9.0' in text
    assert 'pagedserve:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 5.0' in text
    assert 'pagedserve:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 3.0' in text
    with caplog.at_level("INFO", logger="pagedserve.stats"):
        metrics.record_outputs([], SchedulerStats(spec=SpecDecodingStats(3, 9, 5, [3, 1, 1])), now=time.monotonic() + 60)
    assert "mean accepted length 2.67" in caplog.text  # 1 + 5 accepted / 3 drafts
