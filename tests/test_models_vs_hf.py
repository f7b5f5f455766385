"""Greedy outputs and logprobs match HuggingFace transformers on the same weights."""

import pytest
from conftest import PROMPTS, TINY_ARCHS, greedy, hf_greedy, hf_greedy_picks, hf_token_logprobs, most_likely_after, token_ids_of, worker_of

from pagedserve import LLM


def test_default_model_greedy_matches_transformers(default_llm, default_hf_dir, tokenizer):
    prompt_ids = [tokenizer(p).input_ids for p in PROMPTS]
    outputs = default_llm.generate(PROMPTS, greedy(32), use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompt_ids
    for ids, ours in zip(prompt_ids, token_ids_of(outputs)):
        assert ours == hf_greedy_picks(default_hf_dir, ids, ours)
    assert all(len(o.outputs[0].token_ids) == 32 and o.outputs[0].finish_reason == "length" for o in outputs)
    assert outputs[1].outputs[0].text == tokenizer.decode(outputs[1].outputs[0].token_ids, skip_special_tokens=True)


def test_default_model_logprobs_match_transformers(default_llm, default_hf_dir, tokenizer):
    prompt = PROMPTS[2]
    output = default_llm.generate(prompt, greedy(12, logprobs=5), use_tqdm=False)[0].outputs[0]
    reference, full = hf_token_logprobs(default_hf_dir, tokenizer(prompt).input_ids, output.token_ids)
    start = len(tokenizer(prompt).input_ids) - 1
    assert len(output.logprobs) == len(output.token_ids) == 12
    for step, (token_id, position) in enumerate(zip(output.token_ids, output.logprobs)):
        assert position[token_id].logprob == pytest.approx(reference[step], abs=1e-3)
        assert position[token_id].rank == 1  # greedy picks the most likely token
        top5 = full[start + step].topk(5).indices.tolist()
        assert set(position) == set(top5)  # the sampled token is among the top 5 here
    assert output.cumulative_logprob == pytest.approx(sum(reference), abs=1e-2)


@pytest.mark.slow
def test_long_context_decode_matches_transformers(default_llm, default_hf_dir, tokenizer):
    """Decodes after 1100+ tokens of context: the CPU kernel attends to them in parts of 512 and merges
    them; greedy picks and their logprobs still match transformers."""
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 13} stones." for i in range(90))
    prompt_ids = tokenizer(text + " Now, item 91:").input_ids
    assert len(prompt_ids) > 1100
    output = default_llm.generate({"prompt_token_ids": prompt_ids}, greedy(12, logprobs=1), use_tqdm=False)[0].outputs[0]
    reference, full = hf_token_logprobs(default_hf_dir, prompt_ids, list(output.token_ids))
    assert list(output.token_ids) == most_likely_after(full, len(prompt_ids), 12)  # transformers' greedy picks
    for token_id, position, expected in zip(output.token_ids, output.logprobs, reference):
        assert position[token_id].logprob == pytest.approx(expected, abs=1e-3)


def test_prompt_logprobs_match_transformers(default_llm, default_hf_dir, tokenizer):
    prompt = PROMPTS[2]
    prompt_ids = tokenizer(prompt).input_ids
    output = default_llm.generate(prompt, greedy(1, prompt_logprobs=2), use_tqdm=False)[0]
    _, full = hf_token_logprobs(default_hf_dir, prompt_ids[:1], prompt_ids[1:])
    assert output.prompt_logprobs[0] is None
    assert len(output.prompt_logprobs) == len(prompt_ids)
    for index in range(1, len(prompt_ids)):
        entry = output.prompt_logprobs[index]
        assert entry[prompt_ids[index]].logprob == pytest.approx(full[index - 1, prompt_ids[index]].item(), abs=1e-3)
        assert len(entry) <= 3


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_tiny_architectures_match_transformers(arch, tiny_models):
    model_dir = tiny_models[arch]
    prompts = [[1, 400, 500, 600, 700], list(range(100, 170)), [5] * 3]
    llm = LLM(str(model_dir), kv_cache_memory=16 * 1024**2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(24, logprobs=1), use_tqdm=False)
    assert token_ids_of(outputs) == hf_greedy(model_dir, prompts, 24)
    reference, _ = hf_token_logprobs(model_dir, prompts[1], outputs[1].outputs[0].token_ids)
    ours = [pos[tok].logprob for tok, pos in zip(outputs[1].outputs[0].token_ids, outputs[1].outputs[0].logprobs)]
    assert ours == pytest.approx(reference, abs=1e-3)


@pytest.mark.parametrize("settings", [
    {"attention_backend": "torch"},  # the reference backend runs the engine too
    {"attention_backend": "torch", "cpu_kernels": False, "gemm_backend": "torch"},  # no C++ kernel and no oneDNN at all
])
def test_engine_settings_of_kernels_and_gemms_keep_outputs(settings, tiny_models):
    model_dir = tiny_models["llama"]
    prompts = [[1, 400, 500, 600, 700], list(range(100, 170))]
    llm = LLM(str(model_dir), kv_cache_memory=16 * 1024**2, max_num_batched_tokens=32, **settings)
    worker = worker_of(llm)
    assert worker.attn_backend.name == "torch"
    assert (worker.cpu_kernels is None) == (settings.get("cpu_kernels") is False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(16), use_tqdm=False)
    assert token_ids_of(outputs) == hf_greedy(model_dir, prompts, 16)


def test_impossible_kernel_settings_name_the_field(tiny_models):
    with pytest.raises(ValueError, match="attention_backend must be auto, cpu, torch"):
        LLM(str(tiny_models["llama"]), attention_backend="flash")
    with pytest.raises(ValueError, match="attention_backend 'cpu' needs the C\\+\\+ CPU kernels"):
        LLM(str(tiny_models["llama"]), attention_backend="cpu", cpu_kernels=False, kv_cache_memory=2**24)
    with pytest.raises(ValueError, match="attention_backend 'cpu' needs .* float32"):
        LLM(str(tiny_models["llama"]), attention_backend="cpu", dtype="float16", kv_cache_memory=2**24)
    with pytest.raises(ValueError, match="gemm_backend 'onednn' needs a CPU device, float32"):
        LLM(str(tiny_models["llama"]), gemm_backend="onednn", dtype="float16", kv_cache_memory=2**24)


# bfloat16 on CPU is the bfloat16-GEMM mode, judged against transformers' own bfloat16 in test_cpu_bfloat16.py.
@pytest.mark.parametrize("dtype", ["float16"])
def test_half_precision_dtypes_run_and_stay_close_to_float32(dtype, tiny_models):
    model_dir = tiny_models["qwen2"]
    prompts = [{"prompt_token_ids": [1, 400, 500, 600, 700]}]
    half = LLM(str(model_dir), dtype=dtype, kv_cache_memory=8 * 1024**2)
    assert worker_of(half).kv_caches[0].dtype == getattr(__import__("torch"), dtype)
    out = half.generate(prompts, greedy(8, logprobs=0), use_tqdm=False)[0].outputs[0]
    reference, _ = hf_token_logprobs(model_dir, prompts[0]["prompt_token_ids"], out.token_ids)
    assert len(out.token_ids) == 8
    # Half precision changes the numbers a little, not the model: the chosen tokens stay likely under float32.
    assert [pos[tok].logprob for tok, pos in zip(out.token_ids, out.logprobs)] == pytest.approx(reference, abs=0.15)


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype,tolerance", [("bfloat16", 0.1), ("float16", 0.01)])
def test_16bit_kv_cache_holds_twice_the_tokens_and_keeps_the_model(kv_cache_dtype, tolerance, default_llm, default_hf_dir, tokenizer):
    """kv_cache_dtype rounds only the cached K/V: every greedy pick is still transformers' (float32)
    most likely token, its logprob is close to transformers', and the same memory holds twice the blocks."""
    import torch

    memory = 64 * 1024**2
    llm = LLM(kv_cache_dtype=kv_cache_dtype, max_model_len=512, kv_cache_memory=memory)
    worker = worker_of(llm)
    assert worker.kv_caches[0].dtype == getattr(torch, kv_cache_dtype)
    float32_blocks_per_byte = worker_of(default_llm).num_blocks / (512 * 1024**2)
    assert worker.num_blocks == pytest.approx(2 * float32_blocks_per_byte * memory, abs=1)
    outputs = llm.generate(PROMPTS, greedy(32, logprobs=1), use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        prompt_ids, ours = tokenizer(prompt).input_ids, output.outputs[0]
        reference, full = hf_token_logprobs(default_hf_dir, prompt_ids, ours.token_ids)
        start = len(prompt_ids) - 1
        for step, (token_id, position) in enumerate(zip(ours.token_ids, ours.logprobs)):
            assert position[token_id].logprob == pytest.approx(reference[step], abs=tolerance)
            assert full[start + step].max().item() - reference[step] <= tolerance  # transformers' own pick, or a near tie


def test_default_model_runs_on_its_gguf_blocks(default_llm):
    from pagedserve.layers.linear import Linear

    model = worker_of(default_llm).model
    assert all(m.quantized is not None for m in model.modules() if isinstance(m, Linear))
    assert model.quantized_lm_head is not None
