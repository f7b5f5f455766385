"""Disaggregated prefill and decode as a user runs it: a prefill server and a decode server (P2pConnector), and
`pagedserve proxy` in front of them. Answers through the proxy equal the prefill server's own answers to the same
requests (an engine computing everything itself); every block is given back on both sides."""

from __future__ import annotations

import json
import time

import pytest
import requests
from server_utils import RemoteServer, free_port, metric_value
from test_p2p_connector import free_kv_port

MODEL = "tiny"


def p2p_server(tiny_models, role: str, port: int) -> RemoteServer:
    config = {"kv_connector": "P2pConnector", "kv_role": role, "kv_connector_extra_config": {"kv_port": port}}
    return RemoteServer("--model", str(tiny_models["llama"]), "--served-model-name", MODEL, "--dtype", "float32",
                        "--kv-cache-memory", str(8 * 1024**2), "--kv-transfer-config", json.dumps(config))


@pytest.fixture(scope="module")
def cluster(tiny_models):
    prefill = p2p_server(tiny_models, "kv_producer", free_kv_port())
    decode = p2p_server(tiny_models, "kv_consumer", free_kv_port())
    proxy = RemoteServer("--prefill", prefill.url, "--decode", decode.url, subcommand="proxy")
    yield prefill, decode, proxy
    for server in (proxy, decode, prefill):
        server.stop()


def completion(server: RemoteServer, **fields) -> dict:
    response = server.post("/v1/completions", json={"model": MODEL, "temperature": 0, "ignore_eos": True} | fields)
    assert response.status_code == 200, response.text
    return response.json()


def metrics(server: RemoteServer) -> str:
    return server.get("/metrics").text


def settled(server: RemoteServer, timeout_s: float = 30.0) -> str:
    """Its metrics once no block is in use any more (held blocks are given back once the decode side is done)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = metrics(server)
        if metric_value(text, "pagedserve:kv_cache_usage_perc") == 0 or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


PROMPT = "The history of the printing press begins in " * 12


def test_completions_through_the_proxy_equal_one_engines(cluster):
    prefill, decode, proxy = cluster
    for fields in ({"prompt": PROMPT, "max_tokens": 12}, {"prompt": PROMPT + "again", "max_tokens": 6, "n": 2, "logprobs": 2},
                   {"prompt": [PROMPT, "A short one"], "max_tokens": 5}):
        expected = completion(prefill, **fields)
        answer = completion(proxy, **fields)
        assert [(c["index"], c["text"], c["logprobs"]) for c in answer["choices"]] == \
               [(c["index"], c["text"], c["logprobs"]) for c in expected["choices"]]
        assert answer["usage"] == expected["usage"]
    assert metric_value(settled(prefill), "pagedserve:kv_cache_usage_perc") == 0
    text = settled(decode)
    assert metric_value(text, "pagedserve:kv_cache_usage_perc") == 0
    assert metric_value(text, "pagedserve:kv_transfer_received_tokens_total") > 0
    assert metric_value(text, "pagedserve:kv_transfer_received_bytes_total") > 0
    assert metric_value(text, "pagedserve:kv_transfer_load_failures_total") == 0
    assert metric_value(text, "pagedserve:kv_transfer_seconds_count") == 2  # the two-prompt request went whole to decode
    assert metric_value(metrics(prefill), "pagedserve:kv_transfer_sent_bytes_total") == \
           metric_value(text, "pagedserve:kv_transfer_received_bytes_total")


def test_streamed_chat_through_the_proxy_equals_one_engines(cluster):
    prefill, _, proxy = cluster
    messages = [{"role": "user", "content": "Tell me about " + PROMPT}]
    expected = prefill.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    whole = proxy.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert whole.choices[0].message.content == expected.choices[0].message.content
    stream = proxy.openai().chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == expected.choices[0].message.content


def test_the_proxy_passes_errors_models_and_health_through(cluster):
    prefill, decode, proxy = cluster
    bad = proxy.post("/v1/completions", json={"model": MODEL, "prompt": "x", "temperature": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    assert proxy.get("/v1/models").json()["data"][0]["id"] == MODEL
    assert proxy.get("/health").status_code == 200
    from fastapi.testclient import TestClient

    from pagedserve.entrypoints.proxy import build_app

    gone = f"http://127.0.0.1:{free_port()}"
    with TestClient(build_app([gone], [decode.url])) as client:
        health = client.get("/health")
        assert health.status_code == 503 and gone in health.json()["error"]["message"]
        answer = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
        assert answer.status_code == 503 and answer.json()["error"]["type"] == "service_unavailable_error"


def test_a_client_that_goes_away_ends_both_legs(cluster):
    _, decode, proxy = cluster
    with requests.post(proxy.url + "/v1/completions", stream=True, timeout=60,
                       json={"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True}) as response:
        assert response.status_code == 200, response.text
        next(response.iter_lines())
    deadline = time.monotonic() + 30
    while metric_value(metrics(decode), "pagedserve:num_requests_running") > 0:
        assert time.monotonic() < deadline, "the decode instance kept the request of a client that went away"
        time.sleep(0.1)
    assert metric_value(settled(decode), "pagedserve:kv_cache_usage_perc") == 0


def test_params_of_a_prefill_instance_that_is_gone_are_computed_on_the_decode_instance(tiny_models, cluster):
    """The decode instance computes the prompt itself when the blocks cannot be pulled (the prefill instance was
    killed after answering; params naming blocks its request does not hold), and gives every block back on both sides."""
    prefill, decode, _ = cluster
    doomed = p2p_server(tiny_models, "kv_producer", free_kv_port())
    try:
        expected = completion(doomed, prompt=PROMPT, max_tokens=8)
        params = completion(doomed, prompt=PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
        engine_pid = doomed.engine_pid()
    finally:
        doomed.stop(sig=9)
    wait_until_gone(engine_pid)
    failures_before = metric_value(metrics(decode), "pagedserve:kv_transfer_load_failures_total")
    answer = completion(decode, prompt=PROMPT, max_tokens=8, kv_transfer_params=params)
    assert answer["choices"][0]["text"] == expected["choices"][0]["text"]
    held = completion(prefill, prompt=PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    other_blocks = held | {"remote_block_ids": [block + 1 for block in held["remote_block_ids"]]}
    answer = completion(decode, prompt=PROMPT, max_tokens=8, kv_transfer_params=other_blocks)
    assert answer["choices"][0]["text"] == expected["choices"][0]["text"]
    text = settled(decode)
    assert metric_value(text, "pagedserve:kv_transfer_load_failures_total") == failures_before + 2
    assert metric_value(text, "pagedserve:kv_cache_usage_perc") == 0
    assert metric_value(settled(prefill), "pagedserve:kv_cache_usage_perc") == 0  # the refused reader gave the hold back


def wait_until_gone(pid: int, timeout_s: float = 30.0) -> None:
    import os

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} outlived its server")


def test_kv_transfer_params_the_instance_cannot_act_on_are_refused(cluster):
    prefill, decode, _ = cluster
    for server, fields, message, param in [
        (decode, {"kv_transfer_params": {"do_remote_decode": True}}, "must be false on an engine with kv_role kv_consumer",
         "kv_transfer_params.do_remote_decode"),
        (prefill, {"kv_transfer_params": {"do_remote_decode": True}, "stream": True}, "stream must be false", "kv_transfer_params"),
        (prefill, {"kv_transfer_params": {"do_remote_decode": True}, "n": 2}, "n must be 1", "n"),
        (prefill, {"kv_transfer_params": "yes"}, "valid dictionary", "kv_transfer_params"),
    ]:
        response = server.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2} | fields)
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
        assert response.json()["error"]["param"] == param, response.text
