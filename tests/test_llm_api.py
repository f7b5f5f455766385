"""The offline API: prompt forms, ordering, chat, errors, aborts, statistics."""

import json

import pytest
from conftest import PROMPTS, greedy, token_ids_of, worker_of

from pagedserve import LLM, SamplingParams


def test_prompt_forms_and_output_order(default_llm, tokenizer):
    ids = tokenizer(PROMPTS[1]).input_ids
    outputs = default_llm.generate(
        [PROMPTS[0], ids, {"prompt": PROMPTS[2]}, {"prompt_token_ids": ids}],
        [greedy(8), greedy(8), greedy(3), greedy(8)],
        use_tqdm=False,
    )
    assert [o.prompt for o in outputs] == [PROMPTS[0], None, PROMPTS[2], None]
    assert outputs[1].prompt_token_ids == ids and token_ids_of(outputs)[1] == token_ids_of(outputs)[3]
    assert len(outputs[2].outputs[0].token_ids) == 3
    single = default_llm.generate(ids, greedy(8), use_tqdm=False)  # one prompt given as token ids
    assert len(single) == 1 and token_ids_of(single)[0] == token_ids_of(outputs)[1]


def test_chat_uses_the_models_template(default_llm, tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    output = default_llm.chat(messages, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    expected = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False).input_ids
    assert output.prompt_token_ids == expected
    assert output.outputs[0].finish_reason == "stop"  # the template's end-of-turn token ends the reply
    two = default_llm.chat([messages[:2], messages], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(two) == 2 and "Paris" in two[0].outputs[0].text


def test_too_long_prompts_are_rejected_before_queueing(default_llm):
    engine = default_llm.llm_engine
    max_len = engine.max_model_len
    with pytest.raises(ValueError, match=f"more than max_model_len {max_len}"):
        default_llm.generate({"prompt_token_ids": [5] * (max_len + 1)}, greedy(1), use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length"):
        default_llm.generate({"prompt_token_ids": [5] * (max_len - 4)}, greedy(10), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt token ids must be in"):
        default_llm.generate({"prompt_token_ids": [10**9]}, greedy(1), use_tqdm=False)
    with pytest.raises(ValueError, match="must not be empty"):
        default_llm.generate({"prompt_token_ids": []}, greedy(1), use_tqdm=False)
    assert not engine.has_unfinished_requests()
    # max_tokens=None means: up to the context length.
    out = default_llm.generate({"prompt_token_ids": [5] * (max_len - 3)}, SamplingParams(max_tokens=None, ignore_eos=True),
                               use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3 and out[0].outputs[0].finish_reason == "length"


def test_truncate_prompt_tokens_keeps_a_prompts_last_tokens(default_llm, tokenizer):
    """A text or token ids beyond max_model_len, cut to their last tokens: the same ids the whole text's tokenization
    ends with, and the same output as those ids given alone; a shorter prompt is left as it is."""
    max_len = default_llm.llm_engine.max_model_len
    text = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog; " for i in range(400))
    whole = tokenizer(text).input_ids
    assert len(whole) > max_len
    cut = default_llm.generate(text, greedy(6, truncate_prompt_tokens=100), use_tqdm=False)[0]
    assert cut.prompt_token_ids == whole[-100:] and cut.prompt is None
    alone = default_llm.generate({"prompt_token_ids": whole[-100:]}, greedy(6), use_tqdm=False)[0]
    assert cut.outputs[0].token_ids == alone.outputs[0].token_ids
    ids = default_llm.generate({"prompt_token_ids": whole}, greedy(2, truncate_prompt_tokens=50), use_tqdm=False)[0]
    assert ids.prompt_token_ids == whole[-50:]
    short = default_llm.generate("Hello there", greedy(2, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert short.prompt == "Hello there" and short.prompt_token_ids == tokenizer("Hello there").input_ids
    with pytest.raises(ValueError, match=f"truncate_prompt_tokens must be <= max_model_len {max_len}"):
        default_llm.generate(text, greedy(2, truncate_prompt_tokens=max_len + 1), use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer >= 1, or -1"):
        SamplingParams(truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match=f"more than max_model_len {max_len}"):
        default_llm.generate(text, greedy(2), use_tqdm=False)


def test_duplicate_request_id_is_rejected_and_abort_frees_blocks(default_llm):
    engine = default_llm.llm_engine
    engine.add_request("dup", PROMPTS[0], greedy(50))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", PROMPTS[1], greedy(5))
    engine.step()
    engine.step()
    assert engine.get_stats().kv_cache_usage > 0
    engine.abort_request("dup")
    engine.step()
    assert not engine.has_unfinished_requests()
    kv = engine.client.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and engine.get_stats().kv_cache_usage == 0.0


def test_engine_argument_errors_name_the_field():
    with pytest.raises(ValueError, match="block_size must be one of"):
        LLM(block_size=7)
    with pytest.raises(ValueError, match="scheduling_policy must be"):
        LLM(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, float32, bfloat16, float16, int8, fp8, fp8_e4m3, fp8_e5m2, "
                                         "got 'fp4'"):
        LLM(kv_cache_dtype="fp4")
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM(not_a_setting=1)


def test_model_loading_errors_name_the_problem(tmp_path, tiny_models):
    with pytest.raises(FileNotFoundError, match="model not found"):
        LLM(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        LLM(str(tmp_path))
    config = json.loads((tiny_models["llama"] / "config.json").read_text())
    for name, change, message in [
        ("gpt2", {"architectures": ["GPT2LMHeadModel"]}, "unsupported model architecture"),
        ("noweights", {}, "no \\*.safetensors weights"),
    ]:
        model_dir = tmp_path / name
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            LLM(str(model_dir))
    bad = tmp_path / "badjson"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad config.json"):
        LLM(str(bad))
    with pytest.raises(ValueError, match="max_model_len must be <= 1024"):
        LLM(str(tiny_models["llama"]), max_model_len=4096)


def test_kv_cache_size_and_max_model_len_follow_the_budget(tiny_models):
    # The tiny llama: 2 layers x 2 KV heads x 16 dims x 2 (K,V) x 4 bytes = 512 bytes per token.
    llm = LLM(str(tiny_models["llama"]), kv_cache_memory=512 * 16 * 20)
    worker = worker_of(llm)
    assert worker.num_blocks == 20 and worker.max_model_len == 320
    with pytest.raises(ValueError, match="does not fit in the KV cache"):
        LLM(str(tiny_models["llama"]), kv_cache_memory=512 * 16 * 20, max_model_len=512)


def test_generation_config_supplies_the_default_sampling_parameters(tmp_path, tiny_models):
    """--generation-config auto (the default) takes the model's generation_config.json where a request leaves a
    field out; vllm keeps pagedserve's own defaults; a request's own values win."""
    import shutil

    model_dir = tmp_path / "with_generation_config"
    shutil.copytree(tiny_models["llama"], model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 7, "max_new_tokens": 5}))
    llm = LLM(str(model_dir), kv_cache_memory=2**24)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 7, 5)
    prompt = {"prompt_token_ids": [1, 400, 500]}
    by_default = llm.generate(prompt, use_tqdm=False)[0].outputs[0]
    greedy_five = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert by_default.token_ids == greedy_five.token_ids and len(by_default.token_ids) == 5
    plain = LLM(str(model_dir), kv_cache_memory=2**24, generation_config="vllm").get_default_sampling_params()
    assert (plain.temperature, plain.top_k, plain.max_tokens) == (1.0, 0, 16)
    with pytest.raises(FileNotFoundError, match="generation_config"):
        LLM(str(model_dir), kv_cache_memory=2**24, generation_config=str(tmp_path / "nowhere"))


def test_the_engines_start_up_objects_are_out_of_the_garbage_collectors_sight(tiny_models):
    """A full collection walks every object the collector tracks; the engine's own (the model's modules, the KV cache's
    blocks) live as long as it does, so they are frozen once it has started, and a collection in the middle of serving
    walks only what was made since, instead of stalling a step for all of them."""
    import gc

    gc.unfreeze()
    llm = LLM(str(tiny_models["llama"]), num_gpu_blocks_override=4096)
    walked = {id(obj) for obj in gc.get_objects()}
    assert gc.get_freeze_count() > 10 * len(walked)
    blocks = llm.llm_engine.client.engine_core.kv_cache_manager.block_pool.blocks
    assert len(blocks) == 4096 and not any(id(block) in walked for block in blocks)
    llm.llm_engine.shutdown()
