"""Server process life: capacity limits, engine death, clean shutdown. Uses a tiny model to start fast."""

import asyncio
import os
import signal
import time

import openai
import pytest
import requests
from server_utils import RemoteServer

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


def test_engine_death_fails_requests_turns_health_503_and_exits_nonzero(tiny_models):
    server = RemoteServer("--model", str(tiny_models["llama"]), "--kv-cache-memory", str(8 * 1024**2))

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
                if getattr(chunk, "error", None):
                    seen_error = chunk
        except Exception as exc:  # the stream ends with an error event or a broken connection
            seen_error = exc
        return seen_error, count

    try:
        error, count = asyncio.run(main())
        health = _health_until_exit(server)
        server.process.wait(30)
    finally:
        server.stop()
    assert count < 1000
    assert error is not None
    assert health in (503, None)  # 503 while the front end still answers; None once it has exited
    assert server.process.returncode != 0
    assert "engine core is dead" in server.log_text()


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
