"""P2pConnector: a prefill instance holds a finished prompt's blocks; a decode instance given its kv_transfer_params
pulls them over TCP and continues the request as if it had computed the prompt itself. Engines here run in this
process; the servers and the proxy are tested in test_pd_proxy.py."""

from __future__ import annotations

import time

import pytest
from conftest import greedy, token_ids_of

from pagedserve import LLM
from pagedserve.ports import free_port_range

PROMPT = list(range(1000, 1200))  # 12 full blocks of 16, and 8 tokens


def free_kv_port() -> int:
    """A kv_port for an engine of up to three ranks (its own port, then one per rank)."""
    return free_port_range(4)


def p2p(role: str, port: int, **extra) -> dict:
    return {"kv_connector": "P2pConnector", "kv_role": role, "kv_connector_extra_config": {"kv_port": port, **extra}}


def engine(tiny_models, config=None, **settings) -> LLM:
    return LLM(str(tiny_models["llama"]), kv_cache_memory=2**22, dtype="float32", kv_transfer_config=config, **settings)


def params(max_tokens: int, kv_transfer_params: dict):
    return greedy(max_tokens, kv_transfer_params=kv_transfer_params)


def hand_off(producer: LLM, prompt_token_ids: list[int]) -> dict:
    """The prefill instance's kv_transfer_params for the prompt, once its workers serve the blocks."""
    output = producer.generate({"prompt_token_ids": prompt_token_ids}, params(1, {"do_remote_decode": True}), use_tqdm=False)[0]
    settle(producer, lambda: not producer.llm_engine.client.engine_core.has_work())
    return output.kv_transfer_params


def settle(llm: LLM, until, timeout_s: float = 30.0) -> None:
    """Step an idle engine (as a server's engine core loop does) until `until()` holds."""
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, "the engine did not settle"
        llm.llm_engine.client.engine_core.step()
        time.sleep(0.005)


def used_blocks(llm: LLM) -> float:
    return llm.llm_engine.get_stats().kv_cache_usage


@pytest.fixture
def pair(tiny_models):
    port = free_kv_port()
    producer = engine(tiny_models, p2p("kv_producer", port))
    consumer = engine(tiny_models, p2p("kv_consumer", port + 10))
    yield producer, consumer
    producer.llm_engine.shutdown()
    consumer.llm_engine.shutdown()


def test_the_decode_instance_continues_from_the_prefill_instances_kv(tiny_models, pair):
    """The prefill instance's answer carries where the blocks are; the decode instance pulls all of them (nothing in its
    prefix cache), computes only the prompt's last token, and its greedy tokens equal one engine's; both instances give
    every block back once the transfer is done."""
    producer, consumer = pair
    expected = token_ids_of(engine(tiny_models).generate({"prompt_token_ids": PROMPT}, greedy(12), use_tqdm=False))
    first = producer.generate({"prompt_token_ids": PROMPT}, params(1, {"do_remote_decode": True}), use_tqdm=False)[0]
    handoff = first.kv_transfer_params
    assert handoff["do_remote_prefill"] is True and len(handoff["remote_block_ids"]) == 13
    assert used_blocks(producer) > 0  # held for the decode instance
    settle(producer, lambda: not producer.llm_engine.client.engine_core.has_work())  # its workers learn of the hold
    output = consumer.generate({"prompt_token_ids": PROMPT}, params(12, handoff), use_tqdm=False)[0]
    assert token_ids_of([output]) == expected
    settle(producer, lambda: used_blocks(producer) == 0)
    stats = consumer.llm_engine.get_stats()
    assert stats.kv_received_tokens == 200 and stats.kv_received_bytes > 0 and stats.kv_load_failures == 0
    assert producer.llm_engine.get_stats().kv_sent_tokens == 200
    assert used_blocks(consumer) == 0


def test_only_blocks_missing_from_the_decode_instances_prefix_cache_move(tiny_models, pair):
    producer, consumer = pair
    consumer.generate({"prompt_token_ids": PROMPT[:100]}, greedy(1), use_tqdm=False)  # 6 full blocks cached there
    handoff = hand_off(producer, PROMPT)
    expected = token_ids_of(engine(tiny_models).generate({"prompt_token_ids": PROMPT}, greedy(8), use_tqdm=False))
    output = consumer.generate({"prompt_token_ids": PROMPT}, params(8, handoff), use_tqdm=False)[0]
    assert token_ids_of([output]) == expected and output.num_cached_tokens == 96
    assert consumer.llm_engine.get_stats().kv_received_tokens == 200 - 96


@pytest.mark.parametrize("forge", ["unknown_blocks", "wrong_token", "other_prompt", "untrusted_host", "garbled"])
def test_a_load_that_cannot_happen_is_computed_here_and_frees_everything(tiny_models, pair, forge, monkeypatch):
    """Forged or stale parameters never give another request's KV: the decode instance computes the prompt itself
    (kv_load_failure_policy recompute), counts the failure, and holds no block afterwards."""
    from pagedserve.kv_transfer import block_transport

    monkeypatch.setattr(block_transport, "UNKNOWN_HOLD_WAIT_S", 1.0)  # a hold announced late is not tested here
    producer, consumer = pair
    handoff = hand_off(producer, PROMPT)
    forged = dict(handoff)
    if forge == "unknown_blocks":
        forged["remote_request_id"] = "someone-else"
    elif forge == "wrong_token":
        forged["remote_token"] = "0" * 32
    elif forge == "other_prompt":
        forged["remote_prompt_digest"] = "0" * 32
    elif forge == "untrusted_host":
        forged["remote_host"] = "192.0.2.1"
    else:
        forged["remote_block_ids"] = "not a list"
    prompt = PROMPT
    expected = token_ids_of(engine(tiny_models).generate({"prompt_token_ids": prompt}, greedy(6), use_tqdm=False))
    start = time.monotonic()
    output = consumer.generate({"prompt_token_ids": prompt}, params(6, forged), use_tqdm=False)[0]
    assert token_ids_of([output]) == expected
    assert consumer.llm_engine.get_stats().kv_load_failures == 1 and consumer.llm_engine.get_stats().kv_received_tokens == 0
    assert used_blocks(consumer) == 0
    assert time.monotonic() - start < 10


def test_a_hold_nobody_pulls_is_given_back_when_its_lease_ends(tiny_models):
    producer = engine(tiny_models, p2p("kv_producer", free_kv_port(), kv_lease_seconds=0.5))
    try:
        producer.generate({"prompt_token_ids": PROMPT}, params(1, {"do_remote_decode": True}), use_tqdm=False)
        assert used_blocks(producer) > 0
        settle(producer, lambda: used_blocks(producer) == 0, timeout_s=10)
    finally:
        producer.llm_engine.shutdown()


def test_a_request_aborted_while_its_kv_arrives_gives_its_blocks_back_once_the_load_ends(tiny_models, pair):
    producer, consumer = pair
    handoff = hand_off(producer, PROMPT)
    core = consumer.llm_engine.client.engine_core
    consumer.llm_engine.add_request("leaving", {"prompt_token_ids": PROMPT}, params(4, handoff))
    core.step()  # admitted: its blocks allocated, its pull begun
    assert core.scheduler.remote_kv.loading and used_blocks(consumer) > 0
    consumer.llm_engine.abort_request("leaving")
    settle(consumer, lambda: not core.scheduler.remote_kv.loading and used_blocks(consumer) == 0)
    settle(producer, lambda: used_blocks(producer) == 0)


def test_a_request_aborted_before_it_loads_lets_the_prefill_instance_give_its_blocks_back_at_once(tiny_models, pair):
    producer, consumer = pair
    handoff = hand_off(producer, PROMPT)
    consumer.llm_engine.add_request("impatient", {"prompt_token_ids": PROMPT}, params(4, handoff))
    consumer.llm_engine.abort_request("impatient")  # still waiting: it never asked for the blocks
    settle(producer, lambda: used_blocks(producer) == 0, timeout_s=10)  # long before the lease's 120 s


def test_fail_policy_ends_the_request_and_frees_its_blocks(tiny_models, monkeypatch):
    """A prefill instance that is gone (nothing answers): under kv_load_failure_policy fail the request ends."""
    from pagedserve.kv_transfer import p2p as p2p_module

    monkeypatch.setattr(p2p_module, "PULL_TIMEOUT_S", 1.0)
    port = free_kv_port()
    consumer = engine(tiny_models, p2p("kv_consumer", port) | {"kv_load_failure_policy": "fail"})
    try:
        gone = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_request_id": "r", "remote_host": "127.0.0.1",
                "remote_port": free_kv_port(), "remote_token": "t", "remote_block_ids": list(range(13)), "remote_num_tokens": 200,
                "remote_prompt_digest": _digest(PROMPT), "remote_world_size": 1}
        output = consumer.generate({"prompt_token_ids": PROMPT}, params(6, gone), use_tqdm=False)[0]
        assert output.outputs[0].finish_reason == "abort" and output.outputs[0].token_ids == []
        assert used_blocks(consumer) == 0 and consumer.llm_engine.get_stats().kv_load_failures == 1
    finally:
        consumer.llm_engine.shutdown()


def _digest(tokens: list[int]) -> str:
    from pagedserve.kv_transfer.p2p import prompt_digest

    return prompt_digest(tokens)


def test_kv_transfer_params_are_refused_where_the_engine_cannot_act_on_them(tiny_models):
    plain = engine(tiny_models)
    with pytest.raises(ValueError, match="kv_transfer_params must be left out: this engine was not started with --kv-transfer-config"):
        plain.generate({"prompt_token_ids": PROMPT}, params(1, {"do_remote_decode": True}), use_tqdm=False)
    port = free_kv_port()
    consumer = engine(tiny_models, p2p("kv_consumer", port))
    try:
        with pytest.raises(ValueError, match="do_remote_decode must be false on an engine with kv_role kv_consumer"):
            consumer.generate({"prompt_token_ids": PROMPT}, params(1, {"do_remote_decode": True}), use_tqdm=False)
    finally:
        consumer.llm_engine.shutdown()


@pytest.mark.slow
def test_three_tensor_parallel_ranks_pull_from_three(default_model_dir):
    """Both instances split the default model's 3 KV heads over 3 ranks: each rank pulls its share of every block from
    the rank of the same place, and the decode instance's greedy tokens equal one engine's."""
    prompt = {"prompt": "Here is a short story about a robot who learns to paint. It begins on a grey morning when"}
    expected = token_ids_of(LLM(max_model_len=256, kv_cache_memory=2**26).generate(prompt, greedy(8), use_tqdm=False))
    port = free_kv_port()
    producer = LLM(max_model_len=256, kv_cache_memory=2**26, tensor_parallel_size=3, kv_transfer_config=p2p("kv_producer", port))
    consumer = LLM(max_model_len=256, kv_cache_memory=2**26, tensor_parallel_size=3,
                   kv_transfer_config=p2p("kv_consumer", free_kv_port()))
    try:
        handoff = producer.generate(prompt, params(1, {"do_remote_decode": True}), use_tqdm=False)[0].kv_transfer_params
        assert handoff["remote_world_size"] == 3
        settle(producer, lambda: not producer.llm_engine.client.engine_core.has_work())
        assert token_ids_of(consumer.generate(prompt, params(8, handoff), use_tqdm=False)) == expected
        assert consumer.llm_engine.get_stats().kv_load_failures == 0
        settle(producer, lambda: used_blocks(producer) == 0)
    finally:
        producer.llm_engine.shutdown()
        consumer.llm_engine.shutdown()


NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.mark.parametrize("settings", [{"max_num_batched_tokens": 32}, {"speculative_config": NGRAM}], ids=["chunked_prefill", "ngram"])
def test_the_decode_instance_keeps_its_features_over_loaded_kv(tiny_models, settings):
    """A decode instance that chunks its prompts, or verifies n-gram drafts, continues from pulled KV to the tokens one
    engine computes."""
    port = free_kv_port()
    producer = engine(tiny_models, p2p("kv_producer", port))
    consumer = engine(tiny_models, p2p("kv_consumer", free_kv_port()), **settings)
    try:
        repetitive = PROMPT[:40] * 4
        expected = token_ids_of(engine(tiny_models).generate({"prompt_token_ids": repetitive}, greedy(24), use_tqdm=False))
        handoff = hand_off(producer, repetitive)
        assert token_ids_of(consumer.generate({"prompt_token_ids": repetitive}, params(24, handoff), use_tqdm=False)) == expected
        assert consumer.llm_engine.get_stats().kv_received_tokens == len(repetitive)
    finally:
        producer.llm_engine.shutdown()
        consumer.llm_engine.shutdown()


def test_a_transfer_cut_half_way_fails_and_reads_nothing_after_the_cut(monkeypatch):
    """The prefill instance gives a hold back while its blocks are being pulled: the rest is refused (the server never
    reads a released hold's blocks, which the engine may already write again) and the pull fails, so the decode
    instance computes the prompt itself."""
    import torch

    from pagedserve.kv_transfer import block_transport
    from pagedserve.ports import free_port

    monkeypatch.setattr(block_transport, "_BLOCKS_PER_MESSAGE", 2)
    monkeypatch.setattr(block_transport, "UNKNOWN_HOLD_WAIT_S", 0.2)
    source = [torch.randn(2, 16, 4, 2, 8) for _ in range(3)]
    target = [torch.zeros_like(layer) for layer in source]
    address = f"tcp://127.0.0.1:{free_port()}"
    server = block_transport.BlockServer(source, address)
    answered = []
    answer = server._answer

    def answer_then_release(ask):
        result = answer(ask)
        answered.append(ask.block_ids)
        server.release("r")  # the lease ran out after the first message
        return result

    monkeypatch.setattr(server, "_answer", answer_then_release)
    server.hold("r", "token", list(range(8)))
    try:
        with pytest.raises(block_transport.TransferError, match="holds no blocks"):
            block_transport.pull_blocks(target, address, "r", "token", list(range(8)), list(range(8, 16)), timeout_s=5)
    finally:
        server.close()
    assert answered[0] == [0, 1] and all(torch.equal(t[:, 8:10], s[:, 0:2]) for t, s in zip(target, source))
    assert all(not t[:, 10:16].any() for t in target)


def test_a_pull_from_an_instance_that_is_gone_fails_at_once():
    """A killed prefill instance never answers: its port refuses the connection, or drops it while the puller waits.
    Either ends the pull then (so that the decode instance computes the prompt itself), not after timeout_s."""
    import threading

    import torch
    import zmq

    from pagedserve.kv_transfer import block_transport
    from pagedserve.ports import free_port

    target = [torch.zeros(2, 16, 4, 2, 8)]
    with pytest.raises(block_transport.TransferError, match="refused .* the instance is gone"):
        block_transport.pull_blocks(target, f"tcp://127.0.0.1:{free_port()}", "r", "token", [0], [1], timeout_s=60)
    address = f"tcp://127.0.0.1:{free_port()}"
    server = zmq.Context.instance().socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    server.bind(address)

    def take_the_ask_and_die():
        server.recv_multipart()
        server.close()

    dying = threading.Thread(target=take_the_ask_and_die)
    dying.start()
    try:
        with pytest.raises(block_transport.TransferError, match="(dropped|refused) .* the instance is gone"):
            block_transport.pull_blocks(target, address, "r", "token", [0], [1], timeout_s=60)
    finally:
        dying.join()


def test_bad_settings_are_refused_by_name(tiny_models):
    extra = "kv_transfer_config.kv_connector_extra_config."
    for config, message in [(p2p("kv_producer", 80), extra + "kv_port must be an integer in"),
                            (p2p("kv_producer", 20000, kv_lease_seconds=0), extra + "kv_lease_seconds must be a number > 0"),
                            (p2p("kv_consumer", 20000, trusted_producers="me"), extra + "trusted_producers must be a list"),
                            (p2p("kv_consumer", 20000, shared_storage_path="/tmp"), "unknown field"),
                            (p2p("kv_consumer", 20000) | {"kv_load_failure_policy": "retry"},
                             "kv_load_failure_policy must be recompute, fail")]:
        with pytest.raises(ValueError, match=message):
            LLM(str(tiny_models["llama"]), kv_transfer_config=config)
    with pytest.raises(ValueError, match="P2pConnector serves one engine core's blocks"):
        LLM(str(tiny_models["llama"]), kv_transfer_config=p2p("kv_producer", 20000), data_parallel_size=2)
    import socket

    with socket.socket() as taken:
        port = free_port_range(2)  # the engine's port taken here; its rank's, the next, free
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(ValueError, match=f"cannot listen on tcp://127.0.0.1:{port}.*choose another kv_host or kv_port"):
            engine(tiny_models, p2p("kv_producer", port))


@pytest.mark.slow
@pytest.mark.parametrize("settings", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_parallel_ranks_pull_their_share(tiny_models, settings):
    """Tensor-parallel ranks hold their heads of a block, pipeline stages their layers: each pulls its share from the
    prefill instance's rank of the same place."""
    settings = settings | {"distributed_executor_backend": "mp"}
    expected = token_ids_of(engine(tiny_models).generate({"prompt_token_ids": PROMPT}, greedy(10), use_tqdm=False))
    producer = engine(tiny_models, p2p("kv_producer", free_kv_port()), **settings)
    consumer = engine(tiny_models, p2p("kv_consumer", free_kv_port()), **settings)
    try:
        handoff = hand_off(producer, PROMPT)
        assert token_ids_of(consumer.generate({"prompt_token_ids": PROMPT}, params(10, handoff), use_tqdm=False)) == expected
        assert consumer.llm_engine.get_stats().kv_received_tokens == len(PROMPT)
        settle(producer, lambda: used_blocks(producer) == 0)
    finally:
        producer.llm_engine.shutdown()
        consumer.llm_engine.shutdown()


def test_a_load_waits_for_room_in_a_full_cache(tiny_models):
    """Two handed-off prompts whose blocks do not fit together: the second waits (holding nothing) until the first
    ends, then loads; both equal one engine's tokens."""
    prompts = [PROMPT, PROMPT[::-1]]
    expected = token_ids_of(engine(tiny_models).generate([{"prompt_token_ids": p} for p in prompts], greedy(24), use_tqdm=False))
    producer = engine(tiny_models, p2p("kv_producer", free_kv_port()))
    consumer = engine(tiny_models, p2p("kv_consumer", free_kv_port()), num_gpu_blocks_override=20)
    try:
        handoffs = [hand_off(producer, prompt) for prompt in prompts]
        outputs = consumer.generate([{"prompt_token_ids": p} for p in prompts], [params(24, h) for h in handoffs], use_tqdm=False)
        assert token_ids_of(outputs) == expected
        assert consumer.llm_engine.get_stats().kv_received_tokens == 2 * len(PROMPT)
    finally:
        producer.llm_engine.shutdown()
        consumer.llm_engine.shutdown()
