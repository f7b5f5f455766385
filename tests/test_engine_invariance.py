"""Greedy outputs do not depend on prefix caching, chunking, batching or preemption."""

import random

import pytest
from conftest import PROMPTS, engine_core_of, greedy, token_ids_of

from pagedserve import LLM, SamplingParams

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference(default_llm):
    """Each prompt alone (batch of one) on the shared engine."""
    return [token_ids_of(default_llm.generate(p, greedy(MAX_TOKENS), use_tqdm=False))[0] for p in PROMPTS]


def _shared_prefix_prompts(tokenizer):
    prefix = "You are a careful assistant. Answer briefly and precisely. " * 6
    return [prefix + question for question in ("What is 2+2?", "Name a color.", "Say hello.")]


@pytest.mark.slow
def test_prefix_caching_on_and_off_agree(default_model_dir, tokenizer):
    prompts = _shared_prefix_prompts(tokenizer)
    cached = LLM(str(default_model_dir), kv_cache_memory=256 * 1024**2, enable_prefix_caching=True)
    first = cached.generate(prompts[0], greedy(MAX_TOKENS), use_tqdm=False)
    rest = cached.generate(prompts[1:], greedy(MAX_TOKENS), use_tqdm=False)
    # The later requests reuse the shared prefix: only whole blocks, and never the last prompt token.
    shared_tokens = len(tokenizer(prompts[0]).input_ids) - 8
    assert all(o.num_cached_tokens >= (shared_tokens // 16) * 16 - 16 and o.num_cached_tokens > 0 for o in rest)
    assert first[0].num_cached_tokens == 0
    stats = cached.llm_engine.get_stats()
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_queries > stats.prefix_cache_hits
    del cached
    uncached = LLM(str(default_model_dir), kv_cache_memory=256 * 1024**2, enable_prefix_caching=False)
    plain = uncached.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in plain)
    assert token_ids_of(first + rest) == token_ids_of(plain)


def test_chunked_prefill_agrees(default_model_dir, reference):
    llm = LLM(str(default_model_dir), kv_cache_memory=256 * 1024**2, max_num_batched_tokens=8, long_prefill_token_threshold=5)
    assert token_ids_of(llm.generate(PROMPTS, greedy(MAX_TOKENS), use_tqdm=False)) == reference


@pytest.mark.slow
def test_alone_vs_inside_a_batch_of_64_mixed_requests(default_llm, reference, tokenizer):
    rng = random.Random(7)
    vocab = tokenizer.vocab_size
    others = [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(rng.randint(4, 120))]} for _ in range(60)]
    other_params = [
        SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0]), top_p=rng.choice([1.0, 0.9]), max_tokens=rng.randint(1, 40),
                       seed=rng.choice([None, 5]), ignore_eos=True)
        for _ in others
    ]
    mixed = others[:30] + PROMPTS + others[30:]
    params = other_params[:30] + [greedy(MAX_TOKENS)] * len(PROMPTS) + other_params[30:]
    outputs = default_llm.generate(mixed, params, use_tqdm=False)
    assert len(outputs) == 64
    assert token_ids_of(outputs[30:30 + len(PROMPTS)]) == reference
    assert [len(o.outputs[0].token_ids) for o in outputs[:30]] == [p.max_tokens for p in other_params[:30]]


def test_preemption_keeps_outputs_identical(default_model_dir, reference):
    # 14 blocks of 16 tokens cannot hold eight requests of ~10-20 prompt tokens growing by 24 each:
    # running requests must be preempted and recomputed.
    llm = LLM(str(default_model_dir), num_gpu_blocks_override=14, max_model_len=128)
    outputs = llm.generate(PROMPTS * 2, greedy(MAX_TOKENS), use_tqdm=False)
    assert llm.llm_engine.get_stats().num_preemptions > 0
    assert token_ids_of(outputs) == reference * 2
    core = engine_core_of(llm)
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_blocks
