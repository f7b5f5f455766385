"""Sequence classification models (runner pooling over a *ForSequenceClassification checkpoint): each prompt's classes
equal transformers' activation of the same model's logits, through prompts chunked over steps and cached prefixes; a
cross-encoder scores each text pair read together, as transformers does with the tokenizer's pair template; each task
is refused where the model does not give it; the server's /classify, /v1/score and /v1/rerank."""

import numpy as np
import pytest
import torch
from conftest import make_tiny_classifier

from pagedserve.classification import classifier_of

LONG = "Paged attention keeps the cache in blocks, so that no request reserves room it may never use. " * 4
PROMPTS = ["I loved every minute of it", LONG, "The service was slow and the food was cold"]
ENGINE = {"kv_cache_memory": 16 * 1024**2, "max_num_batched_tokens": 32}  # the long prompt runs in chunks
QUERY = "What does paged attention keep in blocks?"
DOCUMENTS = ["The cache, so that no request reserves room it may never use.", "A recipe for bread.", LONG]
SENTIMENTS = {0: "negative", 1: "neutral", 2: "positive"}


@pytest.fixture(scope="module")
def sentiment_model(tmp_path_factory, default_model_dir):
    """A tiny random-weight classifier of three labels (a LlamaForSequenceClassification)."""
    return make_tiny_classifier(tmp_path_factory.mktemp("sentiment"), default_model_dir, "LlamaForSequenceClassification", SENTIMENTS)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory, default_model_dir):
    """A tiny random-weight cross-encoder (a Qwen2ForSequenceClassification of one label) whose tokenizer joins a pair
    with its end-of-text token after each text, as rerankers' tokenizers join a query and a document."""
    from tokenizers import Tokenizer, processors

    out_dir = make_tiny_classifier(tmp_path_factory.mktemp("cross_encoder"), default_model_dir, "Qwen2ForSequenceClassification",
                                   {0: "relevant"})
    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1 <|endoftext|>:1",
                                                             special_tokens=[("<|endoftext|>", 0)])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    return out_dir


def hf_logits(model_dir, token_ids: list[int]) -> np.ndarray:
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].double().numpy()


def softmax(logits: np.ndarray) -> np.ndarray:
    exponents = np.exp(logits - logits.max())
    return exponents / exponents.sum()


def sigmoid(logits: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-logits))


def pooling_llm(model_dir, **engine_args):
    from pagedserve import LLM

    return LLM(str(model_dir), runner="pooling", **ENGINE, **engine_args)


def shut(llm) -> None:
    llm.llm_engine.client.shutdown()


def test_classes_are_transformers_softmax_of_the_score_heads_logits_through_chunks_and_the_prefix_cache(sentiment_model):
    llm = pooling_llm(sentiment_model)
    try:
        # A prompt of one token runs as a decode does.
        outputs = llm.classify([*PROMPTS, [9]], use_tqdm=False)
        logits = llm.classify(PROMPTS[0], use_activation=False, use_tqdm=False)[0]
        again = llm.classify(LONG, use_tqdm=False)[0]
        assert llm.llm_engine.model_info.classifier.labels == ("negative", "neutral", "positive")
    finally:
        shut(llm)
    for prompt, output in zip([*PROMPTS, [9]], outputs):
        assert output.prompt_token_ids == (prompt if isinstance(prompt, list) else llm.get_tokenizer()(prompt).input_ids)
        expected = hf_logits(sentiment_model, output.prompt_token_ids)
        np.testing.assert_allclose(output.outputs.probs, softmax(expected), atol=1e-5)
    np.testing.assert_allclose(logits.outputs.probs, hf_logits(sentiment_model, logits.prompt_token_ids), atol=2e-5, rtol=1e-4)
    # The last token's state needs only that token computed: a repeat reads the rest from the prefix cache.
    assert again.num_cached_tokens > 0
    np.testing.assert_allclose(again.outputs.probs, outputs[1].outputs.probs, atol=1e-6)


def test_a_cross_encoder_scores_each_pair_read_together_as_transformers_does(cross_encoder):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(cross_encoder)
    llm = pooling_llm(cross_encoder)
    try:
        one_to_many = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
        pairwise = llm.score([QUERY, DOCUMENTS[0]], DOCUMENTS[1:], use_tqdm=False)
        truncated = llm.score(QUERY, DOCUMENTS[2], truncate_prompt_tokens=12, use_tqdm=False)[0]
        classes = llm.classify(QUERY, use_tqdm=False)[0]
        with pytest.raises(TypeError, match="a cross-encoder scores texts"):
            llm.score(QUERY, [[5, 6, 7]], use_tqdm=False)
    finally:
        shut(llm)
    for (first, second), output in zip([(QUERY, d) for d in DOCUMENTS] + [(QUERY, DOCUMENTS[1]), (DOCUMENTS[0], DOCUMENTS[2])],
                                       one_to_many + pairwise):
        ids = tokenizer(first, second).input_ids
        assert output.prompt_token_ids == ids and ids.count(0) == 2  # the pair template's two end-of-text tokens
        assert output.outputs.score == pytest.approx(float(sigmoid(hf_logits(cross_encoder, ids))[0]), abs=1e-5)
    ids = tokenizer(QUERY, DOCUMENTS[2]).input_ids[-12:]
    assert truncated.prompt_token_ids == ids
    assert truncated.outputs.score == pytest.approx(float(sigmoid(hf_logits(cross_encoder, ids))[0]), abs=1e-5)
    # One label: its classes are that label's probability, the sigmoid of its logit.
    np.testing.assert_allclose(classes.outputs.probs, sigmoid(hf_logits(cross_encoder, classes.prompt_token_ids)), atol=1e-5)


def test_the_activations_follow_the_models_config():
    from transformers import PretrainedConfig

    def classifier(**values):
        return classifier_of(PretrainedConfig(architectures=["Qwen2ForSequenceClassification"], **values))

    three = classifier(num_labels=3, id2label={0: "a", 1: "b", 2: "c"})
    assert (three.labels, three.classify_activation) == (("a", "b", "c"), "softmax")
    assert classifier(num_labels=3, problem_type="multi_label_classification").classify_activation == "sigmoid"
    assert classifier(num_labels=1, problem_type="regression").classify_activation == "identity"
    # A cross-encoder: sentence-transformers' activation_fn, else the sigmoid of its one logit.
    one = classifier(num_labels=1)
    assert (one.labels, one.classify_activation, one.score_activation) == (("LABEL_0",), "sigmoid", "sigmoid")
    identity = classifier(num_labels=1, sentence_transformers={"activation_fn": "torch.nn.modules.linear.Identity"})
    assert identity.score_activation == "identity" and identity.pair_score(np.array([-3.0])) == -3.0
    older = classifier(num_labels=1, sbert_ce_default_activation_function="torch.nn.modules.activation.Sigmoid")
    assert older.score_activation == "sigmoid"
    assert one.pair_score(np.array([0.5], dtype=np.float32)) == pytest.approx(float(sigmoid(np.array([0.5]))[0]))
    with pytest.raises(ValueError, match="the cross-encoder activation 'torch.nn.modules.activation.Tanh' is not supported"):
        classifier(num_labels=1, sentence_transformers={"activation_fn": "torch.nn.modules.activation.Tanh"})
    assert classifier_of(PretrainedConfig(architectures=["Qwen2ForCausalLM"])) is None


def test_each_task_is_refused_where_the_model_does_not_give_it(sentiment_model, tiny_models):
    from pagedserve import LLM, SamplingParams

    llm = pooling_llm(sentiment_model)
    try:
        with pytest.raises(ValueError, match="does not give embeddings: that takes an engine with runner pooling over an "
                                             "embedding model; its model gives classes"):
            llm.embed("Hello", use_tqdm=False)
        with pytest.raises(ValueError, match="does not give scores of text pairs"):  # three labels: no one score
            llm.score("Hello", "World", use_tqdm=False)
        with pytest.raises(ValueError, match="does not give text"):
            llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
        assert llm.classify("Hello", use_tqdm=False)[0].outputs.probs  # the engine serves on
    finally:
        shut(llm)
    embedder = pooling_llm(tiny_models["llama"])
    try:
        with pytest.raises(ValueError, match="does not give classes: that takes an engine with runner pooling over a "
                                             r"classification model \(a \*ForSequenceClassification checkpoint\); its "
                                             "model gives embeddings and scores of text pairs"):
            embedder.classify("Hello", use_tqdm=False)
    finally:
        shut(embedder)
    with pytest.raises(ValueError, match="LlamaForSequenceClassification is a classification model, without the lm_head"):
        LLM(str(sentiment_model), runner="generate", kv_cache_memory=16 * 1024**2)
    with pytest.raises(ValueError, match="pooler_config.normalize scales an embedding to unit length"):
        pooling_llm(sentiment_model, pooler_config={"normalize": True})


@pytest.fixture(scope="module")
def cross_encoder_server(cross_encoder):
    from server_utils import RemoteServer

    # No --runner: a classification model pools (runner auto).
    server = RemoteServer("--model", str(cross_encoder), "--served-model-name", "reranker", "--kv-cache-memory", str(16 * 1024**2))
    yield server
    assert server.stop() == 0, server.log_text()[-3000:]


@pytest.mark.slow
def test_a_cross_encoders_server_classifies_scores_and_reranks(cross_encoder_server, cross_encoder):
    import transformers

    server = cross_encoder_server
    tokenizer = transformers.AutoTokenizer.from_pretrained(cross_encoder)
    expected = [float(sigmoid(hf_logits(cross_encoder, tokenizer(QUERY, document).input_ids))[0]) for document in DOCUMENTS]
    scored = server.post("/v1/score", json={"model": "reranker", "text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [item["score"] for item in scored["data"]] == pytest.approx(expected, abs=1e-5)
    assert scored["model"] == "reranker"
    assert scored["usage"]["prompt_tokens"] == sum(len(tokenizer(QUERY, document).input_ids) for document in DOCUMENTS)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        reranked = server.post(path, json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2}).json()
        best = sorted(range(len(DOCUMENTS)), key=lambda index: expected[index], reverse=True)[:2]
        assert [(result["index"], result["document"]["text"]) for result in reranked["results"]] == [(i, DOCUMENTS[i]) for i in best]
        assert [result["relevance_score"] for result in reranked["results"]] == pytest.approx([expected[i] for i in best], abs=1e-5)
    classified = server.post("/classify", json={"model": "reranker", "input": [QUERY, DOCUMENTS[1]]}).json()
    ids = [tokenizer(text).input_ids for text in (QUERY, DOCUMENTS[1])]
    assert [(item["index"], item["label"], item["num_classes"]) for item in classified["data"]] == [(0, "relevant", 1), (1, "relevant", 1)]
    for item, prompt_ids in zip(classified["data"], ids):
        assert item["probs"] == pytest.approx(list(sigmoid(hf_logits(cross_encoder, prompt_ids))), abs=1e-5)
    num_tokens = sum(map(len, ids))
    assert classified["usage"] == {"prompt_tokens": num_tokens, "completion_tokens": 0, "total_tokens": num_tokens,
                                   "completion_tokens_details": None}
    logits = server.post("/v1/classify", json={"input": [5, 6, 7], "use_activation": False}).json()
    assert logits["data"][0]["probs"] == pytest.approx(list(hf_logits(cross_encoder, [5, 6, 7])), abs=2e-5)
    # What it refuses, by name; the routes of a text server and of an embedding model's are not here.
    long_pair = server.post("/v1/score", json={"text_1": QUERY, "text_2": "Paged attention " * 700})
    assert long_pair.status_code == 400 and long_pair.json()["error"]["param"] == "text_2"
    assert server.post("/classify", json={"input": "Hi", "use_activation": "yes"}).status_code == 400
    assert server.post("/classify", json={"input": [[49152]]}).json()["error"]["param"] == "input"
    for path in ("/v1/embeddings", "/v1/chat/completions"):
        assert server.post(path, json={"input": "Hi", "messages": []}).status_code == 404
    paths = server.get("/openapi.json").json()["paths"]
    assert {"/classify", "/v1/classify", "/v1/score", "/v1/rerank"} <= set(paths) and "/v1/embeddings" not in paths


@pytest.mark.slow
def test_a_classifiers_server_names_each_inputs_most_probable_label(sentiment_model):
    from server_utils import RemoteServer

    server = RemoteServer("--model", str(sentiment_model), "--runner", "pooling", "--kv-cache-memory", str(16 * 1024**2))
    try:
        classified = server.post("/classify", json={"input": PROMPTS}).json()
        tokens = [server.post("/tokenize", json={"prompt": prompt}).json()["tokens"] for prompt in PROMPTS]
        scores = server.post("/v1/score", json={"text_1": "a", "text_2": "b"})
    finally:
        assert server.stop() == 0, server.log_text()[-3000:]
    for item, ids in zip(classified["data"], tokens):
        probs = softmax(hf_logits(sentiment_model, ids))
        assert item["probs"] == pytest.approx(list(probs), abs=1e-5) and item["num_classes"] == 3
        assert item["label"] == SENTIMENTS[int(np.argmax(probs))]
    assert len({item["label"] for item in classified["data"]}) > 1  # the labels differ: each is its own input's
    assert scores.status_code == 404  # three labels give no one score of a pair
