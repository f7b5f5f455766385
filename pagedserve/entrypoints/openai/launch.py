"""`pagedserve serve` start-up and shutdown: the engine process starts first, and the front end
loads its web stack while the engine loads the model (separate processes, separate cores)."""

from __future__ import annotations

import asyncio
import importlib
import logging
import signal
import sys
from typing import TYPE_CHECKING

from pagedserve.config import EngineConfig
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.openai.settings import ServerSettings

if TYPE_CHECKING:
    import uvicorn

logger = logging.getLogger(__name__)


def _load_web_stack() -> None:
    for module in ("uvicorn", "pagedserve.entrypoints.openai.api_server"):  # FastAPI, pydantic, uvicorn: about a second
        importlib.import_module(module)


def run_server(config: EngineConfig, settings: ServerSettings) -> int:
    """Start the engine core, serve until a signal or engine death; returns the exit code."""
    state = {"server": None, "exit_code": 0}

    def on_engine_dead():
        state["exit_code"] = 1
        if state["server"] is not None:
            state["server"].should_exit = True

    # Until uvicorn installs its own handlers, a SIGTERM during start-up unwinds like Ctrl-C.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    engine = AsyncLLM(config, served_model_name=(settings.served_model_name or [None])[0],
                      max_waiting_requests=settings.max_waiting_requests, on_engine_dead=on_engine_dead,
                      while_starting=_load_web_stack)
    import uvicorn  # noqa: F811 (loaded already, by _load_web_stack)

    from pagedserve.entrypoints.openai.api_server import build_app

    _limit_front_end_threads()
    # uvicorn re-raises the signal that stopped it once it is done: record it instead of dying mid-cleanup.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        app = build_app(engine, settings)
        uv_config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                                   timeout_graceful_shutdown=5)
        server = state["server"] = uvicorn.Server(uv_config)
        asyncio.run(_serve(server, engine))
    finally:
        logger.info("shutting down the engine core")
        engine.shutdown()
        logger.info("engine core stopped")
    if engine.dead_error is not None:
        state["exit_code"] = 1
    return state["exit_code"]


async def _serve(server: uvicorn.Server, engine: AsyncLLM) -> None:
    # From the start, not from the first request: /health and the exit code follow the engine's death.
    engine.start()
    await server.serve()


def _raise_keyboard_interrupt(*_) -> None:
    raise KeyboardInterrupt


def _limit_front_end_threads() -> None:
    # The front end does no tensor math: if anything pulled in torch, keep it off the engine's cores.
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
