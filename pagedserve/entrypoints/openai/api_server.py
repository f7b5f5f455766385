"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of AsyncLLM."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedserve
from pagedserve.config import EngineConfig
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.openai.errors import APIError, api_error_response, error_response
from pagedserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat, render_messages
from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion

logger = logging.getLogger(__name__)


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: list[str] = field(default_factory=list)
    max_waiting_requests: int | None = None
    log_level: str = "info"


def build_app(engine: AsyncLLM, settings: ServerSettings) -> FastAPI:
    names = settings.served_model_name or [engine.config.model]
    completions = OpenAIServingCompletion(engine, names)
    chat = OpenAIServingChat(engine, names)
    app = FastAPI(title="pagedserve", version=pagedserve.__version__)
    _install_error_handlers(app)
    if settings.api_key:
        _install_auth(app, settings.api_key)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if engine.is_healthy else 503)

    @app.get("/version")
    async def version():
        return {"version": pagedserve.__version__}

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=name, root=engine.model_dir, max_model_len=engine.max_model_len) for name in names])

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request):
        return _respond(await completions.create_completion(request, raw_request))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        return _respond(await chat.create_chat_completion(request, raw_request))

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest):
        completions.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if request.messages is not None:
            tokens = render_messages(engine.tokenizer, request.messages, request.add_generation_prompt, None)
        else:
            tokens = engine.tokenizer(request.prompt, add_special_tokens=request.add_special_tokens).input_ids
        return TokenizeResponse(count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        completions.check_model(request.model)
        vocab_size = engine.processor.vocab_size
        if any(not 0 <= t < vocab_size for t in request.tokens):
            raise APIError(400, f"tokens must be in [0, {vocab_size})", param="tokens")
        return DetokenizeResponse(prompt=engine.tokenizer.decode(request.tokens))

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _respond(result):
    if hasattr(result, "__aiter__"):
        return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return JSONResponse(result.model_dump())


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(_, exc: APIError):
        return api_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON body: {message}")
        param = location[0] if location else None
        where = ".".join(location)
        return error_response(400, f"{where}: {message}" if where else message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def on_unexpected(_, exc: Exception):
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


def _install_auth(app: FastAPI, api_key: str) -> None:
    expected = f"Bearer {api_key}"

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if request.url.path.startswith("/v1") and request.headers.get("authorization") != expected:
            return error_response(401, "invalid or missing API key (send 'Authorization: Bearer <key>')")
        return await call_next(request)


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
                      max_waiting_requests=settings.max_waiting_requests, on_engine_dead=on_engine_dead)
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
    if not engine.client.process.is_alive() and engine.dead_error is not None:
        state["exit_code"] = 1
    return state["exit_code"]


async def _serve(server: uvicorn.Server, engine: AsyncLLM) -> None:
    # Watch the engine process even while no request is in flight, so /health and the exit code follow it.
    async def watch_engine():
        while not server.should_exit:
            if not engine.client.process.is_alive():
                engine.mark_dead(RuntimeError(f"engine core exited with code {engine.client.process.exitcode}"))
                return
            await asyncio.sleep(0.5)

    watcher = asyncio.ensure_future(watch_engine())
    try:
        await server.serve()
    finally:
        watcher.cancel()


def _raise_keyboard_interrupt(*_) -> None:
    raise KeyboardInterrupt


def _limit_front_end_threads() -> None:
    # The front end does no tensor math: if anything pulled in torch, keep it off the engine's cores.
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
