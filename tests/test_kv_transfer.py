"""KV connectors: the SharedStorageConnector saves full prompt blocks under a directory and any engine of the same
model and layout loads them, giving the outputs the engine computes itself."""

from __future__ import annotations

import pytest
from conftest import greedy, token_ids_of

from pagedserve import LLM

PROMPT = list(range(1000, 1200))  # 12 full blocks of 16, and 8 tokens


def storage(path, **extra) -> dict:
    return {"kv_connector": "SharedStorageConnector", "kv_connector_extra_config": {"shared_storage_path": str(path), **extra}}


def engine(tiny_models, config=None, **settings) -> LLM:
    return LLM(str(tiny_models["llama"]), kv_cache_memory=2**22, dtype="float32", kv_transfer_config=config, **settings)


def stored_files(path) -> list:
    return [file for file in path.rglob("*") if file.is_file()]


def test_a_fresh_engine_loads_the_prompt_blocks_another_saved(tiny_models, tmp_path):
    """Engine 1 computes and saves; engine 2, started afterwards on the same directory, loads every full block of the
    prompt but the one holding its last token (whose logits it needs), and a prompt sharing a prefix loads that
    prefix: outputs equal an engine without a connector."""
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:100] + list(range(5, 60))}]
    expected = token_ids_of(engine(tiny_models).generate(prompts, greedy(16), use_tqdm=False))
    first = engine(tiny_models, storage(tmp_path)).generate(prompts[:1], greedy(16), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and len(stored_files(tmp_path)) == 12
    second_engine = engine(tiny_models, storage(tmp_path))
    second = second_engine.generate(prompts, greedy(16), use_tqdm=False)
    assert token_ids_of([first]) == expected[:1] and token_ids_of(second) == expected
    assert second[0].num_cached_tokens == 192 and second[1].num_cached_tokens == 96
    # The second prompt's shared prefix came from the engine's own prefix cache (loaded once, for the first prompt); its
    # 3 full blocks past the prefix (155 tokens: 9 blocks, 6 shared) were computed and saved.
    stats = second_engine.llm_engine.get_stats()
    assert (stats.kv_received_tokens, stats.kv_sent_tokens) == (192, 3 * 16)


def test_a_block_found_stays_readable_when_another_engine_evicts_it_before_the_load(tiny_models, tmp_path):
    """The scheduler pins the blocks it finds (hard links): deleting the store's files between the match and the
    workers' read, as another engine's eviction would, loses nothing; the pins go once the step has run."""
    from conftest import engine_core_of

    expected = token_ids_of(engine(tiny_models).generate({"prompt_token_ids": PROMPT}, greedy(8), use_tqdm=False))
    engine(tiny_models, storage(tmp_path)).generate({"prompt_token_ids": PROMPT}, greedy(8), use_tqdm=False)
    llm = engine(tiny_models, storage(tmp_path))
    connector = engine_core_of(llm).scheduler.kv_connector
    match = connector.get_num_new_matched_tokens

    def match_then_evict(request, num_computed_tokens):
        found = match(request, num_computed_tokens)
        for file in stored_files(tmp_path):
            if ".pins" not in file.parts:
                file.unlink()
        return found

    connector.get_num_new_matched_tokens = match_then_evict
    output = llm.generate({"prompt_token_ids": PROMPT}, greedy(8), use_tqdm=False)[0]
    assert output.num_cached_tokens == 192 and token_ids_of([output]) == expected
    assert not [file for file in stored_files(tmp_path) if ".pins" in file.parts]


def test_roles_decide_who_saves_and_who_loads(tiny_models, tmp_path):
    engine(tiny_models, storage(tmp_path) | {"kv_role": "kv_consumer"}).generate({"prompt_token_ids": PROMPT}, greedy(4), use_tqdm=False)
    assert stored_files(tmp_path) == []  # a consumer never writes
    engine(tiny_models, storage(tmp_path) | {"kv_role": "kv_producer"}).generate({"prompt_token_ids": PROMPT}, greedy(4), use_tqdm=False)
    producer = engine(tiny_models, storage(tmp_path) | {"kv_role": "kv_producer"})
    assert producer.generate({"prompt_token_ids": PROMPT}, greedy(4), use_tqdm=False)[0].num_cached_tokens == 0  # never loads
    consumer = engine(tiny_models, storage(tmp_path) | {"kv_role": "kv_consumer"})
    assert consumer.generate({"prompt_token_ids": PROMPT}, greedy(4), use_tqdm=False)[0].num_cached_tokens == 192


def test_loaded_blocks_survive_chunked_prefill_preemption_and_n_samples(tiny_models, tmp_path):
    prompts = [{"prompt_token_ids": list(range(300 + 50 * i, 340 + 50 * i))} for i in range(4)]
    tight = {"max_num_batched_tokens": 16, "num_gpu_blocks_override": 10, "max_model_len": 128}
    expected = token_ids_of(engine(tiny_models, **tight).generate(prompts, greedy(24), use_tqdm=False))
    engine(tiny_models, storage(tmp_path), **tight).generate(prompts, greedy(24), use_tqdm=False)
    loading = engine(tiny_models, storage(tmp_path), **tight)
    outputs = loading.generate(prompts, greedy(24, n=2), use_tqdm=False)
    assert loading.llm_engine.get_stats().num_preemptions > 0
    assert [[list(s.token_ids) for s in o.outputs] for o in outputs] == [[list(e), list(e)] for e in expected]
    assert any(output.num_cached_tokens >= 32 for output in outputs)


def test_speculative_decoding_over_loaded_blocks_keeps_the_greedy_tokens(tiny_models, tmp_path):
    drafting = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    prompt = {"prompt_token_ids": [5, 6] * 75}  # its continuation repeats: the n-gram proposer drafts
    expected = token_ids_of(engine(tiny_models).generate(prompt, greedy(24), use_tqdm=False))
    engine(tiny_models, storage(tmp_path), speculative_config=drafting).generate(prompt, greedy(24), use_tqdm=False)
    loading = engine(tiny_models, storage(tmp_path), speculative_config=drafting)
    output = loading.generate(prompt, greedy(24), use_tqdm=False)[0]
    assert output.num_cached_tokens == 144 and token_ids_of([output]) == expected
    assert loading.llm_engine.get_stats().spec.num_draft_tokens > 0


def test_the_store_stays_within_max_bytes_least_recently_used_out_first(tiny_models, tmp_path, monkeypatch):
    from pagedserve.kv_transfer import shared_storage

    monkeypatch.setattr(shared_storage, "GRACE_S", 0.0)  # the test's blocks are all seconds old
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers, K and V, tokens, KV heads, head size, float32
    llm = engine(tiny_models, storage(tmp_path, max_bytes=20 * block_bytes))
    for index in range(8):
        llm.generate({"prompt_token_ids": list(range(100 * index, 100 * index + 64))}, greedy(2), use_tqdm=False)
        assert sum(file.stat().st_size for file in stored_files(tmp_path)) <= 20 * block_bytes
    assert len(stored_files(tmp_path)) >= 12  # bounded, not emptied
    # The latest prompt's blocks are kept; the first prompt's went first.
    assert llm.generate({"prompt_token_ids": list(range(700, 764))}, greedy(2), use_tqdm=False)[0].num_cached_tokens == 48
    fresh = engine(tiny_models, storage(tmp_path, max_bytes=20 * block_bytes))
    assert fresh.generate({"prompt_token_ids": list(range(0, 64))}, greedy(2), use_tqdm=False)[0].num_cached_tokens == 0


def test_a_block_written_twice_at_once_is_one_whole_file(tmp_path):
    import threading

    from pagedserve.kv_transfer.shared_storage import BlockStore

    store = BlockStore(tmp_path)
    data = bytes(range(256)) * 64
    writers = [threading.Thread(target=store.write, args=("ab" * 20, "tp0-pp0", data)) for _ in range(8)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert [file.name for file in stored_files(tmp_path)] == [f"{'ab' * 20}.tp0-pp0"]
    assert store.read("ab" * 20, "tp0-pp0") == data


def test_blocks_are_keyed_by_prefix_and_by_the_adapters_weights(tmp_path):
    """A block's key names its prefix and the adapter's files, not the adapter's id, which is one engine's name for it:
    after a restart the same id may name other weights, and other engines may give the same weights another id."""
    from pagedserve.config import EngineConfig
    from pagedserve.kv_transfer.shared_storage import SharedStorageScheduler
    from pagedserve.lora_request import CONFIG_FILE, WEIGHTS_FILE, LoRARequest
    from pagedserve.request import Request

    for name, content in (("sql", b"1"), ("chat", b"2")):
        (tmp_path / name).mkdir()
        (tmp_path / name / CONFIG_FILE).write_bytes(b"{}")
        (tmp_path / name / WEIGHTS_FILE).write_bytes(content)

    def keys(prompt, lora=None):
        connector = SharedStorageScheduler(EngineConfig(model="unused", kv_transfer_config=storage(tmp_path / "store")))
        return connector._keys_of(Request("r", prompt, greedy(1), lora_request=lora))

    base = keys(PROMPT)
    same_prefix = keys(PROMPT[:48] + [7] * 32)
    assert len(base) == 12 and base[:3] == same_prefix[:3] and base[3] != same_prefix[3]
    sql = keys(PROMPT, LoRARequest("sql", 1, str(tmp_path / "sql")))
    assert keys(PROMPT, LoRARequest("sql-again", 5, str(tmp_path / "sql"))) == sql  # the same weights under another id
    assert not set(keys(PROMPT, LoRARequest("chat", 1, str(tmp_path / "chat")))) & set(sql)  # the same id, other weights
    assert not set(sql) & set(base)


def test_bad_settings_are_refused_by_name():
    for config, message in [({"kv_connector": "Nope"}, "kv_connector must be SharedStorageConnector"),
                            ({"kv_connector": "SharedStorageConnector"}, "shared_storage_path must be a directory"),
                            (storage("/tmp/x") | {"kv_role": "both"}, "kv_role must be kv_producer, kv_consumer, kv_both"),
                            (storage("/tmp/x", max_bytes=-1), "max_bytes must be an integer > 0"),
                            ({"kv_connector": "SharedStorageConnector", "port": 1}, "unknown field")]:
        with pytest.raises(ValueError, match=message):
            LLM(kv_transfer_config=config)


@pytest.mark.slow
@pytest.mark.parametrize("settings", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_parallel_ranks_each_save_and_load_their_share(tiny_models, tmp_path, settings):
    """Tensor-parallel ranks hold their heads of a block, pipeline stages their layers: each rank its own file."""
    expected = token_ids_of(engine(tiny_models).generate({"prompt_token_ids": PROMPT}, greedy(12), use_tqdm=False))
    settings = settings | {"distributed_executor_backend": "mp"}
    for round_ in range(2):
        llm = engine(tiny_models, storage(tmp_path), **settings)
        try:
            output = llm.generate({"prompt_token_ids": PROMPT}, greedy(12), use_tqdm=False)[0]
        finally:
            llm.llm_engine.shutdown()
        assert token_ids_of([output]) == expected and output.num_cached_tokens == (0, 192)[round_]
    assert len(stored_files(tmp_path)) == 2 * 12  # each rank's share of each block
