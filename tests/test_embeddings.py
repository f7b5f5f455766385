"""Embedding models (runner pooling): each prompt's vector equals transformers' pooling of the same model's final hidden
states, through prompts chunked over steps, cached prefixes and tensor-parallel ranks; the server's /v1/embeddings as
OpenAI's client uses it."""

import base64
import json
import shutil

import numpy as np
import openai
import pytest
import torch
from conftest import TOKENIZER_FILES

from pagedserve.pooling import PoolerConfig, resolve_pooler

LONG = "Paged attention keeps the cache in blocks, so that no request reserves room it may never use. " * 4
PROMPTS = ["Hello world", LONG, "The quick brown fox jumps over the lazy dog"]
ENGINE = {"kv_cache_memory": 16 * 1024**2, "max_num_batched_tokens": 32}  # the long prompt runs in chunks


@pytest.fixture(scope="module")
def embedding_model(tmp_path_factory, default_model_dir):
    """A tiny random-weight base model (no lm_head) saved as embedding models are (Qwen3-Embedding: a Qwen3Model)."""
    import transformers

    out_dir = tmp_path_factory.mktemp("embedding_model")
    config = transformers.Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                                      initializer_range=0.3, bos_token_id=1, eos_token_id=2, use_sliding_window=False)
    torch.manual_seed(7)
    model = transformers.Qwen3Model(config).eval()
    model.config.architectures = ["Qwen3Model"]
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if (default_model_dir / name).exists():
            shutil.copy(default_model_dir / name, out_dir / name)
    return out_dir


def hf_pooled(model_dir, token_ids: list[int], pooling_type: str, normalize: bool, causal_lm: bool = False) -> np.ndarray:
    """transformers' final hidden states of the prompt, pooled."""
    import transformers

    loader = transformers.AutoModelForCausalLM if causal_lm else transformers.AutoModel
    model = loader.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    base = model.model if causal_lm else model
    with torch.no_grad():
        hidden = base(torch.tensor([token_ids])).last_hidden_state[0]
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[pooling_type]
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector.numpy()


def embedding_llm(model_dir, **engine_args):
    from pagedserve import LLM

    return LLM(str(model_dir), runner="pooling", **ENGINE, **engine_args)


def shut(llm) -> None:
    llm.llm_engine.client.shutdown()


@pytest.mark.parametrize("pooling_type, normalize", [("LAST", True), ("MEAN", False), ("CLS", True)])
def test_embeddings_equal_transformers_pooling_through_chunks_and_the_prefix_cache(embedding_model, pooling_type, normalize):
    llm = embedding_llm(embedding_model, pooler_config={"pooling_type": pooling_type, "normalize": normalize})
    try:
        # A prompt of one token runs as a decode does.
        outputs = llm.embed([*PROMPTS, [9]], use_tqdm=False)
        again = llm.embed(LONG, use_tqdm=False)[0]
    finally:
        shut(llm)
    for prompt, output in zip([*PROMPTS, [9]], outputs):
        assert output.prompt_token_ids == (prompt if isinstance(prompt, list) else llm.get_tokenizer()(prompt).input_ids)
        expected = hf_pooled(embedding_model, output.prompt_token_ids, pooling_type, normalize)
        np.testing.assert_allclose(output.outputs.embedding, expected, atol=2e-5, rtol=1e-4)
    # The last token's state needs only that token computed: a repeat reads the rest from the prefix cache. The
    # other poolers read every token's state, so their engine computes every prompt whole.
    assert (again.num_cached_tokens > 0) == (pooling_type == "LAST")
    np.testing.assert_allclose(again.outputs.embedding, outputs[1].outputs.embedding, atol=1e-5)


def test_a_generation_checkpoint_serves_its_hidden_states_and_each_runner_refuses_the_others_requests(tiny_models, embedding_model):
    from pagedserve import LLM, SamplingParams

    llm = embedding_llm(tiny_models["llama"])  # a LlamaForCausalLM: its lm_head is left out
    try:
        # A prompt of one token runs as a decode does.
        output, single = llm.embed([{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9]}], use_tqdm=False)
        with pytest.raises(ValueError, match="does not give text: that takes an engine with runner generate"):
            llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        shut(llm)
    expected = hf_pooled(tiny_models["llama"], [5, 6, 7, 8], "LAST", True, causal_lm=True)
    np.testing.assert_allclose(output.outputs.embedding, expected, atol=2e-5, rtol=1e-4)
    expected = hf_pooled(tiny_models["llama"], [9], "LAST", True, causal_lm=True)
    np.testing.assert_allclose(single.outputs.embedding, expected, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="runner pooling"):  # a base model has no lm_head to generate with
        LLM(str(embedding_model), runner="generate", kv_cache_memory=16 * 1024**2)


def test_a_matryoshka_models_embeddings_are_shortened_on_request(embedding_model):
    # hf_overrides says what the model's config.json does not: the sizes it was trained to be cut to.
    llm = embedding_llm(embedding_model, hf_overrides={"matryoshka_dimensions": [16, 32]})
    try:
        whole, short = (llm.embed(PROMPTS[0], dimensions=size, use_tqdm=False)[0] for size in (None, 16))
        with pytest.raises(ValueError, match=r"dimensions must be one of \[16, 32\], got 8"):
            llm.embed(PROMPTS[0], dimensions=8, use_tqdm=False)
        tokens = whole.prompt_token_ids
    finally:
        shut(llm)
    full = hf_pooled(embedding_model, tokens, "LAST", False)
    assert len(whole.outputs.embedding) == 64 and len(short.outputs.embedding) == 16
    np.testing.assert_allclose(short.outputs.embedding, full[:16] / np.linalg.norm(full[:16]), atol=2e-5, rtol=1e-4)
    plain = embedding_llm(embedding_model)
    try:
        with pytest.raises(ValueError, match="dimensions needs a matryoshka model"):
            plain.embed(PROMPTS[0], dimensions=16, use_tqdm=False)
    finally:
        shut(plain)


def cosine(a, b) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_scores_are_the_cosine_similarity_of_transformers_embeddings(embedding_model):
    llm = embedding_llm(embedding_model)
    try:
        tokenizer = llm.get_tokenizer()
        one_to_many = llm.score(PROMPTS[0], PROMPTS, use_tqdm=False)
        pairwise = llm.score(PROMPTS[:2], PROMPTS[1:], use_tqdm=False)
        with pytest.raises(ValueError, match="text_1 must hold one text, or as many as text_2"):
            llm.score(PROMPTS[:2], PROMPTS, use_tqdm=False)
    finally:
        shut(llm)
    vectors = [hf_pooled(embedding_model, tokenizer(prompt).input_ids, "LAST", True) for prompt in PROMPTS]
    assert [output.outputs.score for output in one_to_many] == pytest.approx([cosine(vectors[0], v) for v in vectors], abs=1e-5)
    assert [output.outputs.score for output in pairwise] == pytest.approx([cosine(vectors[0], vectors[1]),
                                                                          cosine(vectors[1], vectors[2])], abs=1e-5)


def test_an_adapters_embeddings_equal_peft_over_transformers(embedding_model, tmp_path):
    """A LoRA adapter of the base model (PEFT names its modules without the model. prefix) beside the base model."""
    import peft
    import transformers

    from pagedserve import LoRARequest

    torch.manual_seed(3)
    adapted = peft.get_peft_model(transformers.AutoModel.from_pretrained(embedding_model).eval(),
                                  peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                                  init_lora_weights=False))
    adapted.save_pretrained(tmp_path / "adapter")
    ids = [5, 6, 7, 8, 9]
    with torch.no_grad():
        expected = torch.nn.functional.normalize(adapted(input_ids=torch.tensor([ids])).last_hidden_state[0, -1], dim=-1).numpy()
    llm = embedding_llm(embedding_model, enable_lora=True, max_lora_rank=8)
    try:
        with_adapter, without = llm.embed([ids, ids], use_tqdm=False,
                                          lora_request=[LoRARequest("adapter", 1, str(tmp_path / "adapter")), None])
    finally:
        shut(llm)
    np.testing.assert_allclose(with_adapter.outputs.embedding, expected, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(without.outputs.embedding, hf_pooled(embedding_model, ids, "LAST", True), atol=2e-5, rtol=1e-4)


def test_embed_on_a_text_engine_is_refused(default_llm):
    with pytest.raises(ValueError, match="runner pooling"):
        default_llm.embed("Hello", use_tqdm=False)


def test_the_pooler_follows_the_sentence_transformers_config_unless_pooler_config_says_otherwise(tmp_path):
    assert resolve_pooler(None, tmp_path) == PoolerConfig("LAST", True)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert resolve_pooler(None, tmp_path) == PoolerConfig("MEAN", False)
    modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert resolve_pooler(None, tmp_path) == PoolerConfig("MEAN", True)
    assert resolve_pooler({"pooling_type": "LAST"}, tmp_path) == PoolerConfig("LAST", True)


def test_runner_auto_pools_with_a_model_that_only_pools(embedding_model, tiny_models, default_model_dir, tmp_path):
    from conftest import make_tiny_classifier

    from pagedserve.config import EngineConfig

    classifier = make_tiny_classifier(tmp_path, default_model_dir, "Qwen2ForSequenceClassification", {0: "relevant"})
    for model, runner in ((embedding_model, "pooling"), (classifier, "pooling"), (tiny_models["qwen2"], "generate"),
                          ("SmolLM2-135M-Instruct", "generate")):
        assert EngineConfig(model=str(model)).runner == runner, model
    assert EngineConfig(model=str(embedding_model), runner="generate").runner == "generate"  # named: as named


def test_pooler_config_is_checked():
    from pagedserve.config import EngineConfig

    with pytest.raises(ValueError, match="pooler_config.pooling_type must be one of LAST, MEAN, CLS"):
        EngineConfig(runner="pooling", pooler_config={"pooling_type": "max"})
    with pytest.raises(ValueError, match="pooler_config applies with runner pooling"):
        EngineConfig(pooler_config={"pooling_type": "MEAN"})
    with pytest.raises(ValueError, match="speculative_config applies to generated text"):
        EngineConfig(runner="pooling", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="hf_overrides must be a JSON object"):
        EngineConfig(hf_overrides="[16, 32]")


@pytest.mark.slow
def test_tensor_parallel_ranks_give_the_single_process_embeddings(embedding_model):
    single = embedding_llm(embedding_model)
    try:
        expected = [output.outputs.embedding for output in single.embed(PROMPTS, use_tqdm=False)]
    finally:
        shut(single)
    parallel = embedding_llm(embedding_model, tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        got = [output.outputs.embedding for output in parallel.embed(PROMPTS, use_tqdm=False)]
    finally:
        shut(parallel)
    np.testing.assert_allclose(got, expected, atol=2e-5)


@pytest.fixture(scope="module")
def embedding_server(embedding_model):
    from server_utils import RemoteServer

    server = RemoteServer("--model", str(embedding_model), "--served-model-name", "embedder", "--runner", "pooling",
                          "--kv-cache-memory", str(16 * 1024**2))
    yield server
    assert server.stop() == 0, server.log_text()[-3000:]


@pytest.mark.slow
def test_the_embeddings_endpoint_as_openais_client_uses_it(embedding_server, embedding_model):
    client = embedding_server.openai()
    # The client asks for base64 unless told otherwise, and decodes it.
    batch = client.embeddings.create(model="embedder", input=PROMPTS)
    floats = client.embeddings.create(model="embedder", input=[[5, 6, 7, 8]], encoding_format="float")
    assert [item.index for item in batch.data] == [0, 1, 2] and batch.model == "embedder"
    tokenizer_ids = [embedding_server.post("/tokenize", json={"prompt": prompt}).json()["tokens"] for prompt in PROMPTS]
    for ids, item in zip(tokenizer_ids, batch.data):
        np.testing.assert_allclose(item.embedding, hf_pooled(embedding_model, ids, "LAST", True), atol=2e-5, rtol=1e-4)
    assert batch.usage.prompt_tokens == batch.usage.total_tokens == sum(len(ids) for ids in tokenizer_ids)
    np.testing.assert_allclose(floats.data[0].embedding, hf_pooled(embedding_model, [5, 6, 7, 8], "LAST", True), atol=2e-5, rtol=1e-4)
    raw = embedding_server.post("/v1/embeddings", json={"input": "Hello world", "encoding_format": "base64"}).json()
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4"),
                                  np.asarray(batch.data[0].embedding, dtype=np.float32))
    # What it refuses, by name; the routes of a text server are not here.
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model="embedder", input="Hi", dimensions=8)
    assert refused.value.body["param"] == "dimensions"
    for bad_input in ([], "Paged attention " * 700, [[49152]]):  # empty, beyond the context, beyond the vocabulary
        with pytest.raises(openai.BadRequestError) as refused:
            client.embeddings.create(model="embedder", input=bad_input)
        assert refused.value.body["param"] == "input"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="embedder", messages=[{"role": "user", "content": "Hi"}])
    paths = embedding_server.get("/openapi.json").json()["paths"]
    assert "/v1/embeddings" in paths and "/v1/completions" not in paths
    # Scores and reranking: the cosine similarity of the texts' embeddings.
    vectors = [np.asarray(item.embedding) for item in batch.data]
    scored = embedding_server.post("/v1/score", json={"model": "embedder", "text_1": PROMPTS[0], "text_2": PROMPTS}).json()
    assert [item["score"] for item in scored["data"]] == pytest.approx([cosine(vectors[0], v) for v in vectors], abs=1e-5)
    assert scored["usage"]["prompt_tokens"] == len(tokenizer_ids[0]) + batch.usage.prompt_tokens
    reranked_tokens = 0
    for path in ("/v1/rerank", "/v2/rerank"):
        reranked = embedding_server.post(path, json={"query": PROMPTS[0], "documents": PROMPTS[1:], "top_n": 1}).json()
        best = max((1, 2), key=lambda index: cosine(vectors[0], vectors[index]))
        assert [(result["index"], result["document"]["text"]) for result in reranked["results"]] == [(best - 1, PROMPTS[best])]
        reranked_tokens += reranked["usage"]["total_tokens"]
    unlisted = embedding_server.post("/rerank", json={"query": "Hi", "documents": ["a", "b"], "return_documents": False}).json()
    assert sorted(result["index"] for result in unlisted["results"]) == [0, 1]
    assert all(result["document"] is None for result in unlisted["results"])
    reranked_tokens += unlisted["usage"]["total_tokens"]
    mismatched = embedding_server.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert mismatched.status_code == 400 and mismatched.json()["error"]["param"] == "text_1"
    # /metrics counts the embedded prompts' tokens and the requests done.
    metrics = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in embedding_server.get("/metrics").text.splitlines()
               if line.startswith(("pagedserve:prompt_tokens_total{", "pagedserve:request_success_total{"))}
    assert metrics["pagedserve:prompt_tokens_total"] == (batch.usage.prompt_tokens + 4 + raw["usage"]["prompt_tokens"]
                                                         + scored["usage"]["prompt_tokens"] + reranked_tokens)
    embedded = len(PROMPTS) + 2 + 1 + len(PROMPTS) + 2 * len(PROMPTS) + 3  # the embeddings, the score, the reranks
    assert metrics["pagedserve:request_success_total"] == embedded
