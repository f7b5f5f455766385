"""Start and stop a real `pagedserve serve` process for tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import requests

from pagedserve.ports import free_port


class RemoteServer:
    """`pagedserve serve ARGS` (or another subcommand that serves HTTP on --port, such as proxy)."""

    def __init__(self, *args: str, api_key: str | None = None, startup_timeout_s: float = 240.0, subcommand: str = "serve") -> None:
        self.port = free_port()
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pagedserve-server-", suffix=".log", delete=False)
        command = [sys.executable, "-m", "pagedserve.entrypoints.cli", subcommand, "--port", str(self.port), *args]
        if api_key:
            command += ["--api-key", api_key]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._wait_healthy(startup_timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log_text()[-3000:]}")
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not healthy within {timeout_s} s:\n{self.log_text()[-3000:]}")

    def log_text(self) -> str:
        with open(self.log.name) as handle:
            return handle.read()

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def post(self, path: str, headers: dict | None = None, **kwargs) -> requests.Response:
        return requests.post(self.url + path, headers={**self.headers(), **(headers or {})}, timeout=120, **kwargs)

    def get(self, path: str) -> requests.Response:
        return requests.get(self.url + path, headers=self.headers(), timeout=30)

    def openai(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, timeout=300)

    def async_openai(self):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, timeout=300)

    def engine_pid(self) -> int:
        """The engine-core child process (spawned by multiprocessing), not its resource tracker."""
        out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(self.process.pid)], capture_output=True, text=True).stdout
        for line in out.splitlines():
            pid, args = line.strip().split(" ", 1)
            if "spawn_main" in args and "resource_tracker" not in args:
                return int(pid)
        raise RuntimeError(f"no engine process among the server's children:\n{out}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def metric_value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)
