"""`pagedserve serve` start-up and shutdown.

Start-up: the engine process starts first, and the front end loads its web stack while the engine
loads the model (separate processes, separate cores). Shutdown: SIGTERM (or SIGINT) drains the
server: new requests get 503, in-flight ones finish, for at most --shutdown-timeout seconds, after
which they are ended with an error (an error event and [DONE] for a stream, a JSON error for the
rest); then uvicorn closes the connections and the process exits 0. A second SIGINT forces the exit.
The engine's death instead exits non-zero at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import signal
import time

from pagedserve.config import EngineConfig
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.openai.settings import ServerSettings
from pagedserve.executor.cpu_host import limit_front_end_threads
from pagedserve.processes import freeze_start_up_objects

logger = logging.getLogger(__name__)

_DRAIN_POLL_S = 0.05
# After the last request ended, how long uvicorn waits for responses still being written.
_CLOSE_TIMEOUT_S = 5
# File descriptors the front end holds besides client connections: the engine's sockets, logs, libraries.
_FILES_BESIDE_CONNECTIONS = 256


def _load_web_stack() -> None:
    for module in ("uvicorn", "uvloop", "pagedserve.entrypoints.openai.api_server"):  # FastAPI, pydantic, uvicorn: about a second
        importlib.import_module(module)
    freeze_start_up_objects()  # the bulk of them, while the engine starts: what is left once it runs is little


def run_server(config: EngineConfig, settings: ServerSettings) -> int:
    """Start the engine core, serve until a signal or engine death; returns the exit code."""
    holder = {}

    def on_engine_dead():
        if "server" in holder:
            holder["server"].should_exit = True

    # Until the server runs, a SIGTERM during start-up unwinds like Ctrl-C.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    engine = AsyncLLM(config, served_model_name=(settings.served_model_name or [None])[0],
                      max_waiting_requests=settings.max_waiting_requests, on_engine_dead=on_engine_dead,
                      while_starting=_load_web_stack)
    import uvicorn
    import uvloop

    from pagedserve.entrypoints.openai.api_server import ServerState, build_app, serving_models
    from pagedserve.entrypoints.openai.http_protocol import bounded_protocol

    limit_front_end_threads()
    _allow_open_files(settings.max_connections + _FILES_BESIDE_CONNECTIONS)
    state = ServerState()
    try:
        models = serving_models(engine, settings)
        app = build_app(engine, settings, state, models)
        uv_config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                                   timeout_graceful_shutdown=_CLOSE_TIMEOUT_S, timeout_keep_alive=settings.keep_alive_timeout,
                                   http=bounded_protocol(settings.request_read_timeout, settings.max_connections))
        server = holder["server"] = _draining_server_class()(uv_config, engine, state, settings.shutdown_timeout)
        freeze_start_up_objects()
        # uvloop: the loop that wakes for every token of every stream does each wake-up's work in C.
        uvloop.run(_serve(server, engine, models.load_lora_modules))
    finally:
        logger.info("shutting down the engine core")
        engine.shutdown()
        logger.info("engine core stopped")
    return 1 if engine.dead_error is not None else 0


def _allow_open_files(wanted: int) -> None:
    """Raise this process's soft limit on open files to wanted, as far as the hard limit allows: a common default
    (1024) is below --max-connections, and accept() failing for want of descriptors refuses clients without an answer."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft != resource.RLIM_INFINITY and soft < wanted:
        logger.warning("the open-file limit (%d) is below --max-connections plus the server's own files (%d): connections "
                       "beyond it are refused without an answer; raise it (ulimit -n) or lower --max-connections", soft, wanted)


async def _serve(server, engine: AsyncLLM, before_serving) -> None:
    """before_serving: awaited once the engine runs, before the first request (the LoRA modules' loading)."""
    # From the start, not from the first request: /health and the exit code follow the engine's death.
    engine.start()
    await before_serving()
    await server.serve()


def _raise_keyboard_interrupt(*_) -> None:
    raise KeyboardInterrupt


def _draining_server_class():
    import uvicorn  # loaded while the engine started, not at this module's import

    class DrainingServer(uvicorn.Server):
        """uvicorn's server with the drain above in place of its own signal handling (which stops accepting
        at once and, past its timeout, cancels requests mid-response)."""

        def __init__(self, config, engine: AsyncLLM, state, shutdown_timeout: float) -> None:
            super().__init__(config)
            self.engine = engine
            self.state = state
            self.shutdown_timeout = shutdown_timeout
            self._loop = None
            self._drain_task = None

        @contextlib.contextmanager
        def capture_signals(self):
            self._loop = asyncio.get_running_loop()
            previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def _on_signal(self, sig, frame) -> None:
            if self.state.draining:
                if sig == signal.SIGINT:
                    self.should_exit = self.force_exit = True
                return
            self._loop.call_soon_threadsafe(self._begin_drain)

        def _begin_drain(self) -> None:
            self.state.draining = True
            self._drain_task = asyncio.ensure_future(self._drain())

        async def _drain(self) -> None:
            in_flight = self.engine.num_in_flight()
            logger.info("draining: %d requests in flight, up to %.0f s to finish; new requests get 503", in_flight,
                        self.shutdown_timeout)
            deadline = time.monotonic() + self.shutdown_timeout
            while self.engine.num_in_flight() and time.monotonic() < deadline and not self.should_exit:
                await asyncio.sleep(_DRAIN_POLL_S)
            if self.engine.num_in_flight():
                logger.warning("shutdown timeout: ending %d unfinished requests", self.engine.num_in_flight())
                await self.engine.end_all("the server is shutting down")
            self.should_exit = True

    return DrainingServer

