"""LoRA adapters: PEFT directories made by the tests with peft on a tiny random model, served beside the base model in
one batch; each row equals peft's own forward with its adapter."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
import torch
from conftest import assert_matches, engine_core_of, greedy, hf_greedy, token_ids_of

from pagedserve import LLM, LoRARequest
from pagedserve.layers.lora import AdapterProduct, PartProduct

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, targets, seed): ranks and targets differ so that one batch mixes them.
ADAPTERS = {"a1": (8, ALL_TARGETS, 1), "a2": (4, ["q_proj", "v_proj", "down_proj"], 2), "a3": (16, ["o_proj", "gate_proj", "up_proj"], 3)}
PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(40, 90)), [300, 301, 302], list(range(1000, 1040))]


def make_adapter(base_dir, out_dir, rank: int, targets: list[str], seed: int, **config):
    """A random (non-zero) LoRA adapter of the base model, saved by peft."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    lora_config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False, **config)
    get_peft_model(base, lora_config).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def adapters(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {name: make_adapter(tiny_models["llama"], root / name, *spec) for name, spec in ADAPTERS.items()}


def lora(adapters, name: str) -> LoRARequest:
    return LoRARequest(name, list(ADAPTERS).index(name) + 1, str(adapters[name]))


def expected(tiny_models, adapters, name: str | None, prompts, max_tokens: int = 10):
    return hf_greedy(tiny_models["llama"], prompts, max_tokens, adapter_dir=adapters[name] if name else None)


def lora_llm(tiny_models, **kwargs):
    # float32: the mode whose outputs equal transformers' (peft's) token for token.
    settings = {"enable_lora": True, "max_loras": 4, "max_lora_rank": 16, "kv_cache_memory": 2**22, "dtype": "float32"} | kwargs
    return LLM(str(tiny_models["llama"]), **settings)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernel", "torch"])
def test_each_row_of_a_batch_mixing_adapters_and_the_base_model_equals_peft(tiny_models, adapters, cpu_kernels):
    """Three adapters of ranks 8, 4 and 16 over different projections, and the base model, in the same steps; through
    the C++ kernel and through torch's products."""
    llm = lora_llm(tiny_models, cpu_kernels=cpu_kernels)
    names = ["a1", "a2", "a3", None]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(10),
                           lora_request=[lora(adapters, n) if n else None for n in names], use_tqdm=False)
    for output, name, prompt in zip(outputs, names, PROMPTS):
        assert list(output.outputs[0].token_ids) == expected(tiny_models, adapters, name, [prompt])[0], name
    base = token_ids_of(llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], greedy(10), use_tqdm=False))
    assert all(list(output.outputs[0].token_ids) != list(b) for output, b in zip(outputs[:3], base))  # adapters change them


def _random_product(in_features: int, part_sizes: list[int], rank: int, generator: torch.Generator) -> AdapterProduct:
    parts, out_start = [], 0
    for index, size in enumerate(part_sizes):
        parts.append(PartProduct(out_start, size, index * rank, rank, 0.1 * torch.randn(size, rank, generator=generator)))
        out_start += size
    return AdapterProduct(0.1 * torch.randn(rank * len(part_sizes), in_features, generator=generator), parts)


def _reference_add(out: torch.Tensor, x: torch.Tensor, segments, products) -> torch.Tensor:
    """out plus each segment's product with its adapter, row by row in float64."""
    out, row = out.double(), 0
    for adapter_id, num_rows in segments:
        product = products.get(adapter_id)
        if product is not None:
            down = x[row:row + num_rows].double() @ product.a.double().t()
            for part in product.parts:
                columns = down[:, part.rank_start:part.rank_start + part.rank_len]
                out[row:row + num_rows, part.out_start:part.out_start + part.out_len] += columns @ part.b.double().t()
        row += num_rows
    return out


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                    (torch.bfloat16, torch.bfloat16)], ids=["float32", "bfloat16-out", "bfloat16"])
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_a_layers_products_add_each_rows_own_adapter(dtypes, path):
    """One layer (a fused qkv of 3 parts, 37 inputs) in a step of decodes of three adapters, an adapter this layer
    lacks and the base model, then prompt chunks (two of one adapter side by side, then another); ranks 3, 16 and 20
    (not whole vectors)."""
    from pagedserve.layers.cpu_kernels import load
    from pagedserve.layers.lora import LinearLoRA, StepAdapters, adapters_for_step

    kernels = load() if path == "kernel" else None
    if path == "kernel" and kernels is None:
        pytest.fail("the C++ kernels did not build")
    x_dtype, out_dtype = dtypes
    generator = torch.Generator().manual_seed(0)
    products = {1: _random_product(37, [24, 8, 8], 3, generator), 2: _random_product(37, [24, 8, 8], 16, generator),
                5: _random_product(37, [24, 8, 8], 20, generator)}
    layer = LinearLoRA(40, kernels=kernels)
    for adapter_id, product in products.items():
        layer.set_adapter(adapter_id, product)
    segments = [(1, 1), (0, 1), (2, 1), (9, 1), (5, 1), (1, 1), (2, 1), (2, 1), (2, 5), (2, 3), (0, 4), (5, 6)]
    rows = sum(num_rows for _, num_rows in segments)
    x = torch.randn(rows, 37, generator=generator).to(x_dtype)
    out = torch.randn(rows, 40, generator=generator).to(out_dtype)
    expected_out = _reference_add(out, x, segments, products)
    with adapters_for_step(StepAdapters.of(segments)):
        layer.add_to(out, x)
    tolerance = 1e-5 if out_dtype == torch.float32 else 2e-2  # bfloat16 keeps 8 bits
    torch.testing.assert_close(out.double(), expected_out, atol=tolerance, rtol=tolerance)
    layer.remove_adapter(2)  # its rows now keep the layer's output
    before = out.clone()
    with adapters_for_step(StepAdapters.of([(2, 1), (1, 1)])):
        layer.add_to(out[:2], x[:2])
    assert torch.equal(out[0], before[0]) and not torch.equal(out[1], before[1])


def test_a_step_holds_at_most_max_loras_adapters_and_every_request_finishes(tiny_models, adapters):
    """max_loras=2 with three adapters waiting: the third waits for a slot (requests behind it wait too, so it is never
    passed over), and every output still equals peft's."""
    llm = lora_llm(tiny_models, max_loras=2)
    scheduler = engine_core_of(llm).scheduler
    adapters_per_step = []
    schedule = scheduler.schedule

    def recording_schedule():
        output = schedule()
        adapters_per_step.append({scheduler.requests[r].lora_id for r in output.num_scheduled_tokens} - {0})
        return output

    scheduler.schedule = recording_schedule
    names = ["a1", "a2", "a3", "a1", None, "a3"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(6),
                           lora_request=[lora(adapters, n) if n else None for n in names], use_tqdm=False)
    assert max(len(step) for step in adapters_per_step) == 2
    assert any(3 in step for step in adapters_per_step)  # a3 ran, once a slot was free
    for output, name, prompt in zip(outputs, names, prompts):
        assert list(output.outputs[0].token_ids) == expected(tiny_models, adapters, name, [prompt], 6)[0], name


def test_the_prefix_cache_never_gives_one_adapter_the_blocks_another_computed(tiny_models, adapters):
    """The same 48-token prompt under a1, then a2, then the base model, then a1 again: only the repeat hits the cache,
    and each output is its own adapter's."""
    llm = lora_llm(tiny_models)
    prompt = list(range(2000, 2048))
    hits = []
    for name in ["a1", "a2", None, "a1"]:
        output = llm.generate({"prompt_token_ids": prompt}, greedy(8), lora_request=lora(adapters, name) if name else None,
                              use_tqdm=False)[0]
        hits.append(output.num_cached_tokens)
        assert list(output.outputs[0].token_ids) == expected(tiny_models, adapters, name, [prompt], 8)[0], name
    assert hits[:3] == [0, 0, 0] and hits[3] >= 32


def test_chunked_prefill_preemption_and_n_samples_with_adapters(tiny_models, adapters):
    """Prompts cut into 16-token chunks, a cache so small that requests are preempted and recomputed, and n=2 greedy
    samples: each output is still its adapter's."""
    llm = lora_llm(tiny_models, max_num_batched_tokens=16, num_gpu_blocks_override=10, max_model_len=128, block_size=16)
    names = ["a1", "a2", "a3", None]
    prompts = [list(range(100 + 37 * i, 140 + 37 * i)) for i in range(4)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(24, n=2),
                           lora_request=[lora(adapters, n) if n else None for n in names], use_tqdm=False)
    assert engine_core_of(llm).scheduler.num_preemptions > 0
    for output, name, prompt in zip(outputs, names, prompts):
        reference = expected(tiny_models, adapters, name, [prompt], 24)[0]
        assert [list(sample.token_ids) for sample in output.outputs] == [reference, reference], name


def test_speculative_decoding_with_adapters_keeps_each_adapters_greedy_tokens(tiny_models, adapters):
    """n-gram drafts verified in one step run several positions of a request through its adapter (a chunk's rows):
    repetitive prompts make drafts that are accepted, and the tokens stay those of peft's greedy decoding."""
    drafting = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    llm = lora_llm(tiny_models, speculative_config=drafting)
    names = ["a1", "a2", None]
    prompts = [[7, 8, 9, 10] * 6, [21, 22, 23] * 8, [5, 6] * 10]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(16),
                           lora_request=[lora(adapters, n) if n else None for n in names], use_tqdm=False)
    assert engine_core_of(llm).scheduler.get_stats().spec.num_draft_tokens > 0
    for output, name, prompt in zip(outputs, names, prompts):
        assert list(output.outputs[0].token_ids) == expected(tiny_models, adapters, name, [prompt], 16)[0], name


def test_an_adapter_of_the_default_model_equals_peft_and_its_output_follows_a_structure(default_model_dir, default_hf_dir, tokenizer,
                                                                                         tmp_path):
    """A peft adapter of SmolLM2 (its GEMMs on the GGUF blocks and on oneDNN, the adapter's beside them), and a structured
    output under an adapter: the grammar's mask applies to the adapter's logits."""
    from pagedserve import SamplingParams, StructuredOutputsParams

    adapter = make_adapter(default_hf_dir, tmp_path / "smol", 8, ["q_proj", "v_proj", "o_proj", "down_proj"], 11)
    llm = LLM(str(default_model_dir), enable_lora=True, max_lora_rank=8, kv_cache_memory=2**26, max_model_len=512, dtype="float32")
    smol = LoRARequest("smol", 1, str(adapter))
    prompt = tokenizer("The capital of France is").input_ids
    output = llm.generate({"prompt_token_ids": prompt}, greedy(12), lora_request=smol, use_tqdm=False)[0]
    assert list(output.outputs[0].token_ids) == hf_greedy(default_hf_dir, [prompt], 12, adapter_dir=adapter)[0]
    lowercase = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[a-z ]+"))
    structured = llm.generate({"prompt_token_ids": prompt}, lowercase, lora_request=smol, use_tqdm=False)[0].outputs[0].text
    assert structured and all(character.islower() or character == " " for character in structured)


def test_adapters_let_go_for_room_are_read_again_when_needed(tiny_models, adapters):
    """max_cpu_loras=1: each adapter in turn pushes the other out of memory, and comes back from its directory."""
    llm = lora_llm(tiny_models, max_loras=1, max_cpu_loras=1)
    for name in ["a1", "a2", "a1"]:
        output = llm.generate({"prompt_token_ids": PROMPTS[1]}, greedy(8), lora_request=lora(adapters, name), use_tqdm=False)[0]
        assert list(output.outputs[0].token_ids) == expected(tiny_models, adapters, name, [PROMPTS[1]], 8)[0]
        assert engine_core_of(llm).executor.collective_rpc("list_loras") == [[lora(adapters, name).lora_int_id]]


def test_adapters_are_added_and_removed_at_run_time(tiny_models, adapters):
    llm = lora_llm(tiny_models)
    engine = llm.llm_engine
    assert engine.add_lora(lora(adapters, "a2")) is True and engine.add_lora(lora(adapters, "a2")) is False
    assert engine.list_loras() == [2]
    with pytest.raises(ValueError, match="lora_int_id 2 names LoRA adapter 'a2' at .* in this engine"):
        engine.add_lora(LoRARequest("other", 2, str(adapters["a1"])))
    assert engine.remove_lora(2) is True and engine.remove_lora(2) is False
    assert engine.list_loras() == []
    with pytest.raises(ValueError, match="lora_int_id 2 names LoRA adapter 'a2'"):  # removed, an id still means its weights
        engine.add_lora(LoRARequest("other", 2, str(adapters["a1"])))
    assert engine.add_lora(lora(adapters, "a2")) is True and engine.list_loras() == [2]


def test_an_adapter_removed_while_its_requests_run_serves_them_to_the_end(tiny_models, adapters, tmp_path):
    """remove_lora refuses new requests at once; the ranks keep the weights for the requests already running, whose
    directory may be deleted meanwhile, and let them go when the last one ends."""
    copy = shutil.copytree(adapters["a2"], tmp_path / "a2-copy")
    llm = lora_llm(tiny_models)
    engine, core = llm.llm_engine, engine_core_of(llm)
    engine.add_request("running", {"prompt_token_ids": PROMPTS[1]}, greedy(12), lora_request=LoRARequest("a2", 2, str(copy)))
    outputs = [output for _ in range(3) for output in engine.step()]
    assert engine.remove_lora(2) is True and engine.list_loras() == []
    shutil.rmtree(copy)
    assert core.executor.collective_rpc("list_loras") == [[2]]  # still held for the running request
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = [output for output in outputs if output.finished][0]
    assert list(final.outputs[0].token_ids) == expected(tiny_models, adapters, "a2", [PROMPTS[1]], 12)[0]
    assert core.executor.collective_rpc("list_loras") == [[]]


def _broken_copies(adapters, tmp_path):
    """(directory, what the error must say) for each way an adapter can be wrong."""
    cases = []
    missing_weights = shutil.copytree(adapters["a2"], tmp_path / "no_weights")
    (missing_weights / "adapter_model.safetensors").unlink()
    cases.append((missing_weights, "has no adapter_model.safetensors"))
    cases.append((tmp_path / "nowhere", "has no adapter_config.json"))
    bad_json = shutil.copytree(adapters["a2"], tmp_path / "bad_json")
    (bad_json / "adapter_config.json").write_text("{not json")
    cases.append((bad_json, "adapter_config.json is not valid JSON"))
    dora = shutil.copytree(adapters["a2"], tmp_path / "dora")
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    cases.append((dora, "sets use_dora = True, which this engine does not run"))
    cases.append((adapters["a3"], r"has rank 16 at model\.layers\.\d+\.\S+, over max_lora_rank \(8\)"))
    return cases


def test_a_bad_adapter_is_refused_by_name_and_the_engine_keeps_serving(tiny_models, adapters, tmp_path):
    llm = lora_llm(tiny_models, max_lora_rank=8)
    for index, (path, message) in enumerate(_broken_copies(adapters, tmp_path)):
        bad = LoRARequest(f"bad{index}", 100 + index, str(path))
        with pytest.raises(ValueError, match=message):
            llm.generate({"prompt_token_ids": PROMPTS[0]}, greedy(4), lora_request=bad, use_tqdm=False)
    assert llm.llm_engine.list_loras() == []
    assert not engine_core_of(llm).scheduler.has_unfinished_requests()
    output = llm.generate({"prompt_token_ids": PROMPTS[0]}, greedy(8), lora_request=lora(adapters, "a2"), use_tqdm=False)[0]
    assert list(output.outputs[0].token_ids) == expected(tiny_models, adapters, "a2", [PROMPTS[0]], 8)[0]


def test_an_adapter_of_another_model_is_refused_naming_the_layer(tiny_models, tmp_path):
    """Adapters made on models of other shapes: a wider MLP (the shapes do not match), and a third layer (a layer this
    model does not have)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def adapter_of_variant(name, **changes):
        config = LlamaConfig.from_pretrained(tiny_models["llama"])
        for key, value in changes.items():
            setattr(config, key, value)
        LlamaForCausalLM(config).save_pretrained(tmp_path / f"{name}_model")
        return str(make_adapter(tmp_path / f"{name}_model", tmp_path / name, 4, ["gate_proj", "q_proj"], 5))

    llm = lora_llm(tiny_models)
    with pytest.raises(ValueError, match=r"weights for a layer of 64 inputs and 128 outputs are shaped A \(4, 64\) and B \(256, 4\)"):
        llm.llm_engine.add_lora(LoRARequest("wider", 7, adapter_of_variant("wider", intermediate_size=256)))
    with pytest.raises(ValueError, match=r"adapts model\.layers\.2\.\S+, which is not a linear layer of this model"):
        llm.llm_engine.add_lora(LoRARequest("deeper", 8, adapter_of_variant("deeper", num_hidden_layers=3)))
    assert llm.llm_engine.list_loras() == []


def test_lora_requests_are_refused_unless_enabled(tiny_models, adapters):
    llm = LLM(str(tiny_models["llama"]), kv_cache_memory=2**22)
    with pytest.raises(ValueError, match="LoRA adapters are not enabled"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, greedy(4), lora_request=lora(adapters, "a1"), use_tqdm=False)
    with pytest.raises(ValueError, match="max_cpu_loras must be >= max_loras"):
        LLM(str(tiny_models["llama"]), enable_lora=True, max_loras=4, max_cpu_loras=2)


@pytest.mark.slow
@pytest.mark.parametrize("settings", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_adapters_split_over_ranks_as_their_layers_match_the_single_process_engine(tiny_models, adapters, settings):
    """Tensor parallelism cuts each adapter as its base layer (B's rows for q/k/v and gate/up, A's columns for o and
    down, whose partial sums the all-reduce adds); pipeline stages hold their layers' share."""
    names = ["a1", "a2", "a3", None]
    loras = [lora(adapters, n) if n else None for n in names]
    params = greedy(12, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    reference = lora_llm(tiny_models).generate(prompts, params, lora_request=loras, use_tqdm=False)
    parallel = lora_llm(tiny_models, distributed_executor_backend="mp", **settings)
    try:
        outputs = parallel.generate(prompts, params, lora_request=loras, use_tqdm=False)
    finally:
        parallel.llm_engine.shutdown()
    assert_matches(outputs, reference)
    assert [list(o.outputs[0].token_ids) for o in reference] == [expected(tiny_models, adapters, n, [p], 12)[0]
                                                                 for n, p in zip(names, PROMPTS)]


@pytest.fixture(scope="module")
def lora_server(tiny_models, adapters):
    from server_utils import RemoteServer

    server = RemoteServer("--model", str(tiny_models["llama"]), "--kv-cache-memory", str(2**22), "--dtype", "float32", "--enable-lora",
                          "--max-loras", "2", "--lora-modules", f"a1={adapters['a1']}",
                          json.dumps({"name": "a2", "path": str(adapters["a2"])}),
                          "--allow-runtime-lora-updating", api_key="lora-key")
    yield server
    server.stop()


def _completion(client, model: str, prompt: list[int], max_tokens: int = 8):
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, extra_body={"ignore_eos": True})


def expected_text(tiny_models, adapters, name: str | None, prompt: list[int], max_tokens: int = 8) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama"])
    return tokenizer.decode(expected(tiny_models, adapters, name, [prompt], max_tokens)[0], skip_special_tokens=True)


def test_the_server_serves_each_adapter_under_its_name_beside_the_base_model(lora_server, tiny_models, adapters):
    client = lora_server.openai()
    base_name = str(tiny_models["llama"])
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {base_name, "a1", "a2"}
    assert cards["a1"].parent == cards["a2"].parent == base_name and cards["a1"].root == str(adapters["a1"])
    for model, name in ((base_name, None), ("a1", "a1"), ("a2", "a2")):
        response = _completion(client, model, PROMPTS[1])
        assert response.model == model
        assert response.choices[0].text == expected_text(tiny_models, adapters, name, PROMPTS[1]), model
    with pytest.raises(openai.NotFoundError, match="The model `a9` does not exist"):
        _completion(client, "a9", PROMPTS[0])


def test_concurrent_requests_for_different_adapters_each_get_their_own(lora_server, tiny_models, adapters):
    import asyncio

    names = ["a1", "a2", None, "a1", "a2", None]

    async def run_all():
        client = lora_server.async_openai()
        return await asyncio.gather(*(client.completions.create(
            model=name or str(tiny_models["llama"]), prompt=PROMPTS[i % 4], max_tokens=8, temperature=0.0,
            extra_body={"ignore_eos": True}) for i, name in enumerate(names)))

    for i, (name, response) in enumerate(zip(names, asyncio.run(run_all()))):
        assert response.choices[0].text == expected_text(tiny_models, adapters, name, PROMPTS[i % 4]), name
    metrics = lora_server.get("/metrics").text
    assert f'pagedserve:lora_adapters_loaded{{model_name="{tiny_models["llama"]}"}} 2.0' in metrics
    # Both adapters had requests running (their gauges exist), and every request has ended (back at 0).
    for name in ("a1", "a2"):
        assert f'pagedserve:lora_requests_running{{engine="0",lora_name="{name}",model_name="{tiny_models["llama"]}"}} 0.0' in metrics


def test_adapters_load_and_unload_at_run_time_behind_the_api_key(lora_server, tiny_models, adapters):
    import requests

    client = lora_server.openai()
    assert requests.post(lora_server.url + "/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": str(adapters["a3"])},
                         timeout=30).status_code == 401
    loaded = lora_server.post("/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": str(adapters["a3"])})
    assert loaded.status_code == 200 and "a3" in loaded.text
    assert _completion(client, "a3", PROMPTS[0]).choices[0].text == expected_text(tiny_models, adapters, "a3", PROMPTS[0])
    again = lora_server.post("/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": str(adapters["a3"])})
    assert again.status_code == 400 and again.json()["error"]["message"] == "The lora adapter 'a3' has already been loaded."
    broken = lora_server.post("/v1/load_lora_adapter", json={"lora_name": "a4", "lora_path": "/nonexistent/adapter"})
    assert broken.status_code == 400 and "has no adapter_config.json" in broken.json()["error"]["message"]
    assert lora_server.post("/v1/unload_lora_adapter", json={"lora_name": "a3"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _completion(client, "a3", PROMPTS[0])
    missing = lora_server.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "The lora adapter 'a3' cannot be found."
    assert {card.id for card in client.models.list().data} == {str(tiny_models["llama"]), "a1", "a2"}


def test_a_server_whose_lora_module_cannot_be_served_fails_to_start_naming_it(tiny_models, tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--model", str(tiny_models["llama"]),
                             "--kv-cache-memory", str(2**22), "--enable-lora", "--lora-modules", f"broken={tmp_path}"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert f"LoRA module 'broken' ({tmp_path}): LoRA adapter '{tmp_path}' has no adapter_config.json" in result.stderr
