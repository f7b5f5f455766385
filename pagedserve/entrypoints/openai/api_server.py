"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of AsyncLLM."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedserve
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
from pagedserve.entrypoints.openai.settings import ServerSettings

logger = logging.getLogger(__name__)



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
        return ModelList(data=[ModelCard(id=name, root=engine.model_info.model_dir, max_model_len=engine.max_model_len) for name in names])

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
        vocab_size = engine.model_info.vocab_size
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
