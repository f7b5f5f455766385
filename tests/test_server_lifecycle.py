"""Server process life: capacity limits, engine death, clean shutdown. Uses a tiny model to start fast."""

import asyncio
import json
import os
import signal
import time

import openai
import pytest
import requests
from server_utils import RemoteServer, metric_value

# Each test starts and stops server processes.
pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as handle:  # a zombie is gone for our purposes
        return handle.read().split()[2] != "Z"


def test_requests_beyond_the_waiting_limit_get_503(tiny_models):
    server = RemoteServer("--model", str(tiny_models["llama"]), "--max-num-seqs", "1", "--max-waiting-requests", "1",
                          "--kv-cache-memory", str(8 * 1024**2), "--served-model-name", "tiny")
    try:
        async def main():
            client = server.async_openai()

            async def one(i):
                try:
                    await client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=300, extra_body={"ignore_eos": True})
                    return 200
                except openai.APIStatusError as exc:
                    assert exc.response.json()["error"]["code"] == 503
                    return exc.status_code

            return await asyncio.gather(*(one(i) for i in range(6)))

        statuses = asyncio.run(main())
        assert 503 in statuses and 200 in statuses
        assert set(statuses) <= {200, 503}
        # Once the queue drains, new requests are admitted again.
        assert server.openai().completions.create(model="tiny", prompt=[5], max_tokens=2).choices[0].finish_reason
    finally:
        assert server.stop() == 0


def test_sigterm_and_sigint_shut_down_cleanly_without_orphans(tiny_models):
    for sig in (signal.SIGTERM, signal.SIGINT):
        server = RemoteServer("--model", str(tiny_models["qwen3"]), "--kv-cache-memory", str(8 * 1024**2))
        try:
            engine_pid = server.engine_pid()
        finally:
            returncode = server.stop(sig)
        assert returncode == 0
        deadline = time.monotonic() + 10
        while _alive(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(engine_pid), "the engine core process outlived the server"


def _wait_until_engine_holds(server, count: int, timeout_s: float = 120) -> None:
    """Poll /metrics until the engine has count requests running or waiting."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        metrics = requests.get(server.url + "/metrics", timeout=10).text
        held = sum(metric_value(metrics, f'pagedserve:num_requests_{state}{{engine="0",model_name="tiny"}}')
                   for state in ("running", "waiting"))
        if held >= count:
            return
        time.sleep(0.02)
    raise AssertionError(f"the engine never held {count} requests")


def _stream_until_done(server, body: dict) -> dict:
    """Read one completion stream to its end: its text, finish reason, error event and whether [DONE] came."""
    result = {"text": "", "finish_reason": None, "error": None, "done": False, "status": None}
    try:
        with requests.post(server.url + "/v1/completions", json={**body, "stream": True}, headers=server.headers(), stream=True,
                           timeout=120) as response:
            result["status"] = response.status_code
            for line in response.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    result["done"] = True
                    continue
                payload = json.loads(line[6:])
                if "error" in payload:
                    result["error"] = payload["error"]
                for choice in payload.get("choices", []):
                    result["text"] += choice["text"]
                    result["finish_reason"] = choice["finish_reason"] or result["finish_reason"]
    except requests.RequestException as exc:
        result["error"] = str(exc)
    return result


@pytest.mark.parametrize("shutdown_timeout,finish", [(60, True), (1, False)])
def test_sigterm_drains_in_flight_requests(tiny_models, shutdown_timeout, finish):
    """SIGTERM under load: new requests get 503, in-flight ones finish (or, past --shutdown-timeout, end with
    an error event and [DONE], or a JSON error), the server exits 0 with a clean log."""
    import concurrent.futures

    server = RemoteServer("--model", str(tiny_models["llama"]), "--served-model-name", "tiny", "--kv-cache-memory", str(16 * 1024**2),
                          "--max-num-seqs", "8", "--shutdown-timeout", str(shutdown_timeout))
    # SIGTERM comes once the engine holds all 14 requests, with hundreds of steps to go: in flight on any machine.
    # Two waves of 600 tokens outlast the checks below; 1000 tokens take the tiny model past a 1 s timeout.
    length = 600 if finish else 1000
    stream_body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": length, "ignore_eos": True}
    pool = concurrent.futures.ThreadPoolExecutor(16)
    try:
        streams = [pool.submit(_stream_until_done, server, stream_body) for _ in range(10)]
        plain = [pool.submit(server.post, "/v1/completions", json=stream_body) for _ in range(4)]
        _wait_until_engine_holds(server, 14)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = server.post("/v1/completions", json={"model": "tiny", "prompt": [5], "max_tokens": 2})
        health = requests.get(server.url + "/health", timeout=10).status_code
        results = [future.result(timeout=180) for future in streams]
        answers = [future.result(timeout=180) for future in plain]
        returncode = server.process.wait(120)
    finally:
        pool.shutdown(wait=False)
        server.stop()
    assert refused.status_code == 503 and refused.json()["error"]["message"] == "the server is shutting down"
    assert health == 503
    assert returncode == 0
    assert all(r["done"] and r["status"] == 200 for r in results), results
    if finish:
        assert all(r["finish_reason"] == "length" and r["error"] is None for r in results)
        assert all(a.status_code == 200 and a.json()["choices"][0]["finish_reason"] == "length" for a in answers)
    else:
        assert all(r["error"] is not None and r["error"]["code"] == 503 and r["finish_reason"] is None for r in results)
        assert all(a.status_code == 503 and a.json()["error"]["message"] == "the server is shutting down" for a in answers)
    log = server.log_text()
    assert "Traceback" not in log and "leaked semaphore" not in log and "Exception in ASGI" not in log, log[-3000:]


def test_an_abort_storm_leaves_nothing_running_waiting_or_cached(tiny_models):
    """Hundreds of streams, each cancelled at a random moment: afterwards the engine holds no request and no block."""
    import random

    server = RemoteServer("--model", str(tiny_models["llama"]), "--served-model-name", "tiny", "--kv-cache-memory", str(16 * 1024**2))
    rng = random.Random(0)

    async def one(client, index):
        stream = await client.completions.create(model="tiny", prompt=[5 + index % 50, 6, 7], max_tokens=200, stream=True,
                                                 extra_body={"ignore_eos": True})
        stop_after = rng.randrange(0, 30)
        seen = 0
        async for _ in stream:
            seen += 1
            if seen >= stop_after:
                break
        await stream.close()

    async def main():
        client = server.async_openai()
        await asyncio.gather(*(asyncio.wait_for(one(client, i), 120) for i in range(300)), return_exceptions=True)

    try:
        asyncio.run(main())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            metrics = server.get("/metrics").text
            state = [metric_value(metrics, f"pagedserve:{name}") for name in
                     ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")]
            if state == [0, 0, 0]:
                break
            time.sleep(0.2)
        assert state == [0, 0, 0]
        assert server.post("/v1/completions", json={"model": "tiny", "prompt": [5], "max_tokens": 3}).status_code == 200
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("engine_args", [[], ["-dp", "2"]], ids=["one engine core", "two engine cores"])
def test_engine_death_fails_requests_turns_health_503_and_exits_nonzero(tiny_models, engine_args):
    """With data parallelism too: a core's death ends every stream with an error and the server at once (it does not
    go on serving with the cores left: a replica that lost part of itself says so, and its supervisor restarts it)."""
    server = RemoteServer("--model", str(tiny_models["llama"]), "--kv-cache-memory", str(8 * 1024**2), *engine_args)
    killed_at = []

    async def long_request():
        async_client = server.async_openai()
        return await async_client.completions.create(model=str(tiny_models["llama"]), prompt=[5, 6], max_tokens=1000,
                                                     stream=True, extra_body={"ignore_eos": True})

    async def main():
        stream = await long_request()
        seen_error = None
        try:
            count = 0
            async for chunk in stream:
                count += 1
                if count == 3:
                    os.kill(server.engine_pid(), signal.SIGKILL)
                    killed_at.append(time.monotonic())
                if getattr(chunk, "error", None):
                    seen_error = chunk
        except Exception as exc:  # the stream ends with an error event or a broken connection
            seen_error = exc
        return seen_error, count

    try:
        error, count = asyncio.run(main())
        health = _health_until_exit(server)
        server.process.wait(30)
        noticed_after = time.monotonic() - killed_at[0]
    finally:
        server.stop()
    assert noticed_after < 3, f"the server went on {noticed_after:.1f} s after its engine core died"
    assert count < 1000
    assert error is not None
    assert health in (503, None)  # 503 while the front end still answers; None once it has exited
    assert server.process.returncode != 0
    assert "engine core is dead: engine core process died (killed by SIGKILL)" in server.log_text()


def test_startup_failure_is_reported(tmp_path):
    with pytest.raises(RuntimeError, match="server exited"):
        RemoteServer("--model", str(tmp_path / "missing"))


def _health_until_exit(server: RemoteServer, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    health = None
    while time.monotonic() < deadline and server.process.poll() is None:
        try:
            health = requests.get(server.url + "/health", timeout=2).status_code
        except requests.RequestException:
            return None
        if health == 503:
            return health
        time.sleep(0.1)
    return health
