"""The OpenAI-compatible server, driven by the official openai client against a real server process."""

import asyncio
import json
import re
import time

import openai
import pytest
from conftest import hf_token_logprobs
from server_utils import RemoteServer, metric_value

API_KEY = "test-secret"
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The three most important inventions in history are"
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def server(default_model_dir):
    server = RemoteServer("--max-model-len", "1024", "--kv-cache-memory", str(256 * 1024**2), api_key=API_KEY)
    yield server
    assert server.stop() == 0, server.log_text()[-2000:]


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def test_models_health_version_and_auth(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert server.get("/health").status_code == 200
    assert server.get("/version").json()["version"]
    import requests

    unauthorized = requests.get(server.url + "/v1/models", timeout=10)
    assert unauthorized.status_code == 401 and unauthorized.json()["error"]["type"] == "authentication_error"
    assert requests.get(server.url + "/health", timeout=10).status_code == 200  # only /v1 needs the key


def test_lora_adapters_are_off_unless_enabled(server, client):
    """A server started without --enable-lora and --allow-runtime-lora-updating loads no adapter at run time."""
    refused = server.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"})
    assert refused.status_code == 404 and "--allow-runtime-lora-updating" in refused.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="x", prompt="Hi", max_tokens=1)


def test_stream_and_non_stream_agree_and_usage_is_exact(server, client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, extra_body={"ignore_eos": True}, **GREEDY)
    tokens = server.post("/tokenize", json={"prompt": PROMPT}).json()
    assert full.usage.prompt_tokens == tokens["count"]
    assert full.usage.completion_tokens == 20 and full.usage.total_tokens == tokens["count"] + 20
    assert full.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens == tokens["count"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_and_non_stream_agree_with_template_applied(server, client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=24, **GREEDY)
    rendered = server.post("/tokenize", json={"messages": messages}).json()
    assert reply.usage.prompt_tokens == rendered["count"]
    detok = server.post("/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
    assert detok.startswith("<|im_start|>system\nYou are terse.<|im_end|>") and detok.endswith("<|im_start|>assistant\n")
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    assert reply.choices[0].message.role == "assistant"


def test_multi_turn_chat_and_prompt_forms(client, server):
    ids = server.post("/tokenize", json={"prompt": "Hello"}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=5, **GREEDY)
    by_text = client.completions.create(model=MODEL, prompt=["Hello", "Bye"], max_tokens=5, **GREEDY)
    assert [c.index for c in by_ids.choices] == [0, 1] == [c.index for c in by_text.choices]
    assert by_ids.choices[0].text == by_ids.choices[1].text == by_text.choices[0].text != by_text.choices[1].text
    assert by_text.usage.completion_tokens == 10
    echo = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, echo=True, **GREEDY)
    assert echo.choices[0].text == "Hello" + by_text.choices[0].text
    conversation = [{"role": "user", "content": "My name is Ana."}, {"role": "assistant", "content": "Hello Ana!"},
                    {"role": "user", "content": [{"type": "text", "text": "What is my name?"}]}]
    reply = client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=16, **GREEDY)
    as_strings = [{**m, "content": "What is my name?"} if isinstance(m["content"], list) else m for m in conversation]
    rendered = server.post("/tokenize", json={"messages": as_strings}).json()
    assert reply.usage.prompt_tokens == rendered["count"]  # every turn went through the template
    text = server.post("/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
    # the template adds its default system turn, then the three turns and the generation prompt
    assert text.count("<|im_start|>") == 5 and "Hello Ana!<|im_end|>" in text


def test_stop_strings(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, **GREEDY).choices[0].text
    stop = full[10:14]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, stop=[stop], **GREEDY).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, stop=stop, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.text


def test_n_with_seed_is_reproducible_and_distinct(client):
    def run():
        response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, n=3, seed=42, temperature=1.0)
        return [c.text for c in sorted(response.choices, key=lambda c: c.index)]

    first, second = run(), run()
    assert first == second and len(set(first)) == 3
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a joke."}], n=2, seed=3,
                                          temperature=1.0, max_tokens=12)
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_logprobs_shapes_and_values_match_transformers(client, server, default_hf_dir):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=3, **GREEDY)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert all(1 <= len(top) <= 4 for top in logprobs.top_logprobs)
    # Values: echo returns the prompt's logprobs, whose token ids are known exactly; compare them to transformers.
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1, **GREEDY)
    prompt_ids = server.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    prompt_logprobs = echoed.choices[0].logprobs.token_logprobs[: len(prompt_ids)]
    reference, _ = hf_token_logprobs(default_hf_dir, prompt_ids[:1], prompt_ids[1:])
    assert prompt_logprobs[0] is None and prompt_logprobs[1:] == pytest.approx(reference, abs=1e-3)
    assert "".join(echoed.choices[0].logprobs.tokens[: len(prompt_ids)]) == PROMPT
    assert all(lp == pytest.approx(max(top.values()), abs=1e-6) for lp, top in zip(logprobs.token_logprobs, logprobs.top_logprobs))
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, logprobs=True,
                                          top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token for entry in content)
    assert all(entry.logprob <= 0 and entry.bytes == list(entry.token.encode()) for entry in content)


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "lots"}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "top_p"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 50}, 400, "logprobs"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"49152": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"5": 100.5}}, 400, "logit_bias"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "truncate_prompt_tokens": 1025}, 400, "truncate_prompt_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "allowed_token_ids": [49152]}, 400, "allowed_token_ids"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logit_bias": {"a": 1}}, 400,
         "logit_bias"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 5000}, 400, None),
        ("/v1/completions", {"model": MODEL, "prompt": [7] * 1100, "max_tokens": 1}, 400, None),
        ("/v1/completions", {"model": MODEL, "prompt": [10**8]}, 400, None),
        ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ("/v1/completions", {"model": MODEL}, 400, "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
         "top_logprobs"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400,
         "max_completion_tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
         "messages"),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client, path, body, status, param):
    response = server.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert error["code"] == ("model_not_found" if status == 404 else status)
    if param is not None:
        assert error["param"] == param
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None


def test_logit_bias_and_allowed_token_ids_ban_and_force_tokens(server, client):
    def first_token(text):
        return server.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"][0]

    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, **GREEDY).choices[0].text
    banned = first_token(plain)
    unbanned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logit_bias={str(banned): -100}, **GREEDY)
    assert first_token(unbanned.choices[0].text) != banned
    forced = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                            logit_bias={"1000": 100}, extra_body={"ignore_eos": True}, **GREEDY)
    assert forced.choices[0].message.content == server.post("/detokenize", json={"tokens": [1000] * 3}).json()["prompt"]
    kept = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, extra_body={"allowed_token_ids": [2000], "ignore_eos": True},
                                     **GREEDY)
    assert kept.choices[0].text == server.post("/detokenize", json={"tokens": [2000] * 3}).json()["prompt"]


def test_truncate_prompt_tokens_serves_prompts_beyond_the_context(server, client):
    text = "".join(f"Item {i} of a long list of things to remember. " for i in range(300))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=text, max_tokens=2)
    cut = client.completions.create(model=MODEL, prompt=text, max_tokens=2, extra_body={"truncate_prompt_tokens": 64}, **GREEDY)
    assert cut.usage.prompt_tokens == 64
    tail = server.post("/tokenize", json={"prompt": text}).json()["tokens"][-64:]
    alone = client.completions.create(model=MODEL, prompt=tail, max_tokens=2, **GREEDY)
    assert cut.choices[0].text == alone.choices[0].text


def test_malformed_json_and_the_openai_client_errors(server, client):
    response = server.post("/v1/completions", data="{not json", headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model=MODEL, prompt="x" * 10, max_tokens=5000)
    assert "maximum context length" in str(excinfo.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_32_concurrent_streams_complete_with_exact_token_counts(server):
    async def one(async_client, index):
        stream = await async_client.completions.create(model=MODEL, prompt=f"Story number {index}:", max_tokens=8 + index % 9,
                                                       stream=True, stream_options={"include_usage": True},
                                                       extra_body={"ignore_eos": True})
        text, usage = "", None
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return usage.completion_tokens, text

    async def main():
        async_client = server.async_openai()
        return await asyncio.gather(*(one(async_client, i) for i in range(32)))

    results = asyncio.run(main())
    assert [count for count, _ in results] == [8 + i % 9 for i in range(32)]
    assert all(text for _, text in results)


def _wait_until_idle(server, timeout_s: float) -> tuple[float, str]:
    """(seconds until nothing runs and the KV cache is empty, the last metrics read)."""
    start = time.monotonic()
    while True:
        metrics = server.get("/metrics").text
        idle = (metric_value(metrics, "pagedserve:kv_cache_usage_perc") == 0
                and metric_value(metrics, "pagedserve:num_requests_running") == 0)
        if idle or time.monotonic() - start > timeout_s:
            return time.monotonic() - start, metrics
        time.sleep(0.05)


def test_client_disconnect_aborts_and_frees_the_kv_cache(server):
    import requests

    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 900, "stream": True, "ignore_eos": True}
    with requests.post(server.url + "/v1/completions", json=body, headers=server.headers(), stream=True, timeout=60) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(10)]
        assert any(line.startswith(b"data:") for line in received)
        assert metric_value(server.get("/metrics").text, "pagedserve:kv_cache_usage_perc") > 0
    _, metrics = _wait_until_idle(server, 30)
    assert metric_value(metrics, "pagedserve:kv_cache_usage_perc") == 0
    assert metric_value(metrics, "pagedserve:num_requests_running") == 0
    assert metric_value(metrics, "pagedserve:generation_tokens_total") < 2000  # it did not run to 900 tokens


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_client_that_hangs_up_on_a_plain_response_frees_its_slot_and_blocks_at_once(server, path):
    """Not streamed: a client that closes its socket before the answer has its request aborted within a second, as a
    streaming one does (else large requests from clients that hang up could fill the engine)."""
    import socket

    body = {"model": MODEL, "max_tokens": 900, "ignore_eos": True}
    body |= {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": PROMPT}]}
    payload = json.dumps(body).encode()
    request = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload
    with socket.create_connection(("127.0.0.1", server.port)) as connection:
        connection.sendall(request)
        deadline = time.monotonic() + 30
        while metric_value(server.get("/metrics").text, "pagedserve:num_requests_running") == 0:
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.05)
    seconds, metrics = _wait_until_idle(server, 30)
    assert seconds < 1.5, f"still running {seconds:.1f} s after the client hung up"
    assert metric_value(metrics, "pagedserve:num_requests_running") == 0


def test_greedy_text_is_the_same_alone_and_amid_24_concurrent_requests(server, client):
    alone = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, **GREEDY).choices[0].text

    async def main():
        async_client = server.async_openai()
        others = [async_client.completions.create(model=MODEL, prompt=f"Request {i} says", max_tokens=10 + i, temperature=0.9,
                                                  seed=i) for i in range(24)]
        target = async_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, **GREEDY)
        results = await asyncio.gather(*others[:12], target, *others[12:])
        return results[12].choices[0].text

    assert asyncio.run(main()) == alone


def test_metrics_expose_the_engine_state(server):
    text = server.get("/metrics").text
    for name in ("pagedserve:num_requests_running", "pagedserve:num_requests_waiting", "pagedserve:kv_cache_usage_perc",
                 "pagedserve:prefix_cache_queries_total", "pagedserve:prefix_cache_hits_total", "pagedserve:num_preemptions_total",
                 "pagedserve:prompt_tokens_total", "pagedserve:generation_tokens_total",
                 "pagedserve:time_to_first_token_seconds_bucket", "pagedserve:inter_token_latency_seconds_bucket",
                 "pagedserve:e2e_request_latency_seconds_bucket", "pagedserve:request_success_total"):
        assert name in text, name
    assert metric_value(text, "pagedserve:prompt_tokens_total") > 0
    assert metric_value(text, "pagedserve:prefix_cache_hits_total") > 0  # the tests above repeat prompts


# ---- structured outputs -------------------------------------------------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "languages": {"type": "array", "items": {"type": "string", "enum": ["en", "fr", "de"]}}},
          "required": ["name", "age", "languages"]}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_response_format_parses_and_validates_streamed_or_not(client, temperature):
    import jsonschema

    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    reply = client.chat.completions.create(model=MODEL, messages=messages, response_format=response_format, max_tokens=100,
                                           temperature=temperature, seed=5)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    chunks = client.chat.completions.create(model=MODEL, messages=messages, response_format=response_format, max_tokens=100,
                                            temperature=temperature, seed=5, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content


def test_regex_choice_and_json_object_on_both_endpoints(client):
    phone = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=20,
                                      extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}}).choices[0]
    assert re.fullmatch(r"\d{3}-\d{4}", phone.text) and phone.finish_reason == "stop"
    older_name = client.completions.create(model=MODEL, prompt="Is water wet?", max_tokens=5, extra_body={"guided_choice": ["yes", "no"]})
    assert older_name.choices[0].text in ("yes", "no")
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick a side."}], max_tokens=5,
                                            extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert answer.choices[0].message.content in ("left", "right")
    anything = client.completions.create(model=MODEL, prompt='{"a": 1}\n{"b": 2}\n{"c": 3}\n', max_tokens=60,
                                         extra_body={"response_format": {"type": "json_object"}}, **GREEDY).choices[0]
    assert anything.finish_reason == "stop" and isinstance(json.loads(anything.text), dict)


def _strict_json(text: str):
    """JSON as the standard has it: -Infinity and NaN are not JSON (a browser's JSON.parse refuses them)."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_of_tokens_a_structure_rules_out_are_json_numbers(server, stream):
    """Where only the end of text may follow, every other top logprob is -inf: both endpoints answer with valid JSON,
    those logprobs as the lowest number the API reports, the chosen token's as its own."""
    choice = {"structured_outputs": {"choice": ["yes", "no"]}, "max_tokens": 3, "temperature": 0, "stream": stream}
    requests_ = [("/v1/completions", {"prompt": "Is the sky blue?", "logprobs": 5, **choice}),
                 ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Is the sky blue?"}], "logprobs": True,
                                           "top_logprobs": 5, **choice})]
    for path, body in requests_:
        response = server.post(path, json={"model": MODEL, **body})
        assert response.status_code == 200, response.text
        events = ([line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
                  if stream else [response.text])
        values = []
        for event in events:
            for entry in _strict_json(event)["choices"]:
                logprobs = entry.get("logprobs")  # a streamed chat chunk leaves out what it does not carry
                if logprobs is None:
                    continue
                if path == "/v1/completions":
                    values += logprobs["token_logprobs"] + [v for top in logprobs["top_logprobs"] for v in top.values()]
                else:
                    values += [v for e in logprobs["content"] for v in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))]
        assert -9999.0 in values and all(-9999.0 <= value <= 0.0 for value in values), (path, values)


@pytest.mark.parametrize("fields,param,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}}, "response_format",
     "Unsupported type"),
    ({"extra_body": {"structured_outputs": {"regex": "(a"}}}, "structured_outputs", "parenthesis"),
    ({"extra_body": {"guided_grammar": "root ::= "}}, "guided_grammar", "EBNF"),
    ({"extra_body": {"guided_json": "{not json"}}, "guided_json", "not JSON"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs", "exactly one"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex", "given once"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"extra_body": {"structured_outputs": {"regex": "a+"}, "min_tokens": 2}}, "min_tokens", "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"regexp": "a+"}}}, "structured_outputs", "not a field"),
])
def test_unusable_structures_are_400s_naming_the_field_and_the_server_goes_on(client, fields, param, message):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, **fields)
    error = raised.value.body
    assert error["param"] == param and message in error["message"], error
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                           extra_body={"guided_choice": ["fine"]})
    assert reply.choices[0].message.content == "fine"
