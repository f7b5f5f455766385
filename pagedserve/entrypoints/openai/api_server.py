"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of AsyncLLM."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.openai.chat_template import ChatTemplateRenderer
from pagedserve.entrypoints.openai.errors import APIError, install_error_handlers
from pagedserve.entrypoints.openai.middleware import install_middleware
from pagedserve.entrypoints.openai.openapi_schema import ServedLimits, served_schema
from pagedserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ClassificationRequest,
    ClassificationResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelList,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
    VersionResponse,
)
from pagedserve.entrypoints.openai.responses_protocol import (
    DeletedResponse,
    Includable,
    InputItemList,
    ResponseObject,
    ResponsesRequest,
)
from pagedserve.entrypoints.openai.responses_store import ResponseStore
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_classification import OpenAIServingClassification
from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedserve.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagedserve.entrypoints.openai.serving_models import ServingModels
from pagedserve.entrypoints.openai.serving_pooling import OpenAIServingPooling
from pagedserve.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagedserve.entrypoints.openai.serving_score import OpenAIServingScores
from pagedserve.entrypoints.openai.settings import ServerSettings
from pagedserve.entrypoints.openai.web_console import install_web_console
from pagedserve.version import __version__

logger = logging.getLogger(__name__)

_ERRORS = {status: {"model": ErrorResponse, "description": description} for status, description in (
    (400, "bad input: the message names the field"), (401, "missing or wrong API key"),
    (404, "unknown model, or no stored response of that id"),
    (413, "request body over the limit"), (500, "a server bug: the message names the request id to look up in the log"),
    (503, "at capacity, shutting down, or the engine is gone"),
)}
# Where a stored response's state may not allow what is asked.
_RESPONSE_ERRORS = {**_ERRORS, 409: {"model": ErrorResponse, "description": (
    "a stored response in a state that does not allow it: cancelling one not run in the background, continuing one "
    "still running, streaming again one not streamed in the background")}}
# Generation endpoints answer JSON, or an event stream with "stream": true. Before OpenAPI 3.2 (FastAPI writes 3.1) an
# event stream's schema describes each event: its data is a JSON chunk, or [DONE] at the end.
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a JSON chunk of the response (or an error object), or [DONE] at the end"},
    "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}
_STREAMS = {"text/event-stream": {"schema": _SSE_EVENT}}
_PLAIN_TEXT = {"description": "what was done, in words", "content": {"text/plain": {"schema": {"type": "string"}}}}
# How long /metrics waits for the engine cores to report their experts' token counts (they answer between steps).
_EXPERT_METRICS_TIMEOUT_S = 5.0


@dataclass
class ServerState:
    draining: bool = False  # set on SIGTERM: new requests get 503 while in-flight ones finish


def build_app(engine: AsyncLLM, settings: ServerSettings, state: ServerState | None = None,
              models: ServingModels | None = None) -> FastAPI:
    """models: the served names (a new ServingModels of the settings' names when None); the caller loads its
    --lora-modules (ServingModels.load_lora_modules) before serving."""
    state = state or ServerState()
    models = models or serving_models(engine, settings)
    max_n = settings.effective_max_n(engine.config.max_num_seqs)
    renderer = ChatTemplateRenderer(engine.tokenizer, settings.trust_request_chat_template, settings.chat_template_timeout,
                                    settings.chat_template)
    engine.front_end.cap_unrequested_tokens(settings.default_max_tokens)
    completions = OpenAIServingCompletion(engine, models, max_n)
    chat = OpenAIServingChat(engine, models, max_n, renderer, settings.auto_tool_call_parser,
                             engine.config.reasoning_parser)
    responses = OpenAIServingResponses(chat, ResponseStore(settings.max_stored_responses))
    app = FastAPI(title="pagedserve", version=__version__)
    install_error_handlers(app)

    def is_serving() -> bool:
        return engine.is_healthy and not state.draining

    install_middleware(app, settings, is_draining=lambda: state.draining, is_serving=is_serving)
    if settings.web_console:
        engine.engine_view.show_prompts = settings.web_console_show_prompts
        install_web_console(app, engine, settings.web_console_interval)

    @app.get("/health", response_class=Response, responses={
        200: {"description": "serving", "content": {}}, 503: {"description": "the engine is gone or the server is shutting down"}})
    async def health():
        return Response(status_code=200 if is_serving() else 503)

    @app.get("/version", response_model=VersionResponse, responses=_ERRORS)
    async def version():
        return VersionResponse(version=__version__)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def list_models():
        return ModelList(data=models.cards())

    def check_runtime_lora_updating() -> None:
        if not settings.allow_runtime_lora_updating:
            raise APIError(404, "loading and unloading LoRA adapters at run time is off; start the server with "
                           "--allow-runtime-lora-updating", code="not_found")

    @app.post("/v1/load_lora_adapter", responses={**_ERRORS, 200: _PLAIN_TEXT})
    async def load_lora_adapter(request: LoadLoRAAdapterRequest):
        check_runtime_lora_updating()
        await models.load_lora_adapter(request.lora_name, request.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", responses={**_ERRORS, 200: _PLAIN_TEXT})
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest):
        check_runtime_lora_updating()
        await models.unload_lora_adapter(request.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")

    if engine.config.runner == "pooling":
        _add_pooling_routes(app, engine.front_end.tasks, engine, models, max_n)
    else:
        _add_generation_routes(app, completions, chat, responses)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(request: TokenizeRequest):
        completions.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            tokens = await asyncio.to_thread(chat.prompt_token_ids, request.messages, request.add_generation_prompt,
                                             request.chat_template, request.chat_template_kwargs)
        else:
            try:
                tokens = await asyncio.to_thread(engine.front_end.processor.tokenize_text, request.prompt, request.add_special_tokens)
            except ValueError as exc:
                raise APIError.bad_request(exc, param="prompt") from exc
        return TokenizeResponse(count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(request: DetokenizeRequest):
        completions.check_model(request.model)
        vocab_size = engine.model_info.vocab_size
        if any(t >= vocab_size for t in request.tokens):
            raise APIError(400, f"tokens must be in [0, {vocab_size})", param="tokens")
        if len(request.tokens) > engine.max_model_len:
            raise APIError(400, f"at most max_model_len ({engine.max_model_len}) tokens at once, got {len(request.tokens)}",
                           param="tokens")
        return DetokenizeResponse(prompt=await asyncio.to_thread(engine.tokenizer.decode, request.tokens))

    prometheus_text = {"description": "Prometheus text format", "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}

    @app.get("/metrics", response_class=Response, responses={**_ERRORS, 200: prometheus_text})
    async def metrics():
        try:
            await asyncio.wait_for(engine.refresh_expert_metrics(), _EXPERT_METRICS_TIMEOUT_S)
        except (TimeoutError, RuntimeError) as exc:  # the engine gone or a rank failing: the rest is served all the same
            logger.warning("the experts' token counts were not read for /metrics: %s", exc)
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    limits = ServedLimits(engine.model_info.vocab_size, max_n, engine.max_model_len, settings.trust_request_chat_template,
                          engine.model_info.matryoshka_dimensions)
    app.openapi = lambda: served_schema(app, limits)
    return app


def serving_models(engine: AsyncLLM, settings: ServerSettings) -> ServingModels:
    return ServingModels(engine, settings.served_model_name or [engine.config.model], settings.lora_modules)



def _add_generation_routes(app: FastAPI, completions: OpenAIServingCompletion, chat: OpenAIServingChat,
                           responses: OpenAIServingResponses) -> None:
    """The routes of a server that generates text (runner generate)."""

    @app.post("/v1/completions", response_model=CompletionResponse, responses={**_ERRORS, 200: {"content": _STREAMS}})
    async def create_completion(request: CompletionRequest, raw_request: Request):
        return _respond(await completions.create_completion(request, raw_request))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={**_ERRORS, 200: {"content": _STREAMS}})
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        return _respond(await chat.create_chat_completion(request, raw_request))

    @app.post("/v1/responses", response_model=ResponseObject, responses={**_RESPONSE_ERRORS, 200: {"content": _STREAMS}})
    async def create_response(request: ResponsesRequest, raw_request: Request):
        return _respond(await responses.create_response(request, raw_request))

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject, responses={**_RESPONSE_ERRORS, 200: {"content": _STREAMS}})
    async def get_response(response_id: str, stream: bool = False, starting_after: Annotated[int | None, Query(ge=0)] = None):
        # stream: a streamed background response's events again, after the one numbered starting_after.
        if stream:
            return _respond(responses.stream_again(response_id, starting_after))
        if starting_after is not None:
            raise APIError(400, "starting_after picks up a stream: give stream true", param="starting_after")
        return _respond(responses.get(response_id))

    @app.delete("/v1/responses/{response_id}", response_model=DeletedResponse, responses=_ERRORS)
    async def delete_response(response_id: str):
        return _respond(await responses.delete(response_id))

    @app.get("/v1/responses/{response_id}/input_items", response_model=InputItemList, responses=_ERRORS)
    async def list_input_items(response_id: str, after: str | None = None, limit: Annotated[int, Query(ge=1, le=100)] = 20,
                               order: Literal["asc", "desc"] = "desc", include: Annotated[list[Includable] | None, Query()] = None,
                               include_listed: Annotated[list[Includable] | None, Query(alias="include[]")] = None):
        # include[]: the form in which OpenAI's clients send a list in a query.
        with_logprobs = "message.output_text.logprobs" in (include or []) + (include_listed or [])
        return _respond(responses.input_items(response_id, after, limit, order, with_logprobs))

    @app.post("/v1/responses/{response_id}/cancel", response_model=ResponseObject, responses=_RESPONSE_ERRORS)
    async def cancel_response(response_id: str):
        return _respond(await responses.cancel(response_id))


def _add_pooling_routes(app: FastAPI, tasks: tuple[str, ...], engine: AsyncLLM, models: ServingModels, max_n: int) -> None:
    """The routes of a server with runner pooling, those of its model's tasks (pagedserve/tasks.py): an embedding model's
    embeddings, a classification model's classes (vLLM's /classify, and /v1/classify), and the scores of text pairs
    (vLLM's paths, the unversioned ones and Cohere's /v2/rerank too)."""
    if "embed" in tasks:
        embeddings = OpenAIServingEmbedding(engine, models, max_n)

        @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_ERRORS)
        async def create_embedding(request: EmbeddingRequest, raw_request: Request):
            return _respond(await embeddings.create_embedding(request, raw_request))

    if "classify" in tasks:
        classification = OpenAIServingClassification(engine, models, max_n)

        async def create_classify(request: ClassificationRequest, raw_request: Request):
            return _respond(await classification.create_classify(request, raw_request))

        for path in ("/classify", "/v1/classify"):
            app.post(path, response_model=ClassificationResponse, responses=_ERRORS)(create_classify)

    if "score" in tasks:
        scores = OpenAIServingScores(OpenAIServingPooling(engine, models, max_n))

        async def score(request: ScoreRequest, raw_request: Request):
            return _respond(await scores.score(request, raw_request))

        async def rerank(request: RerankRequest, raw_request: Request):
            return _respond(await scores.rerank(request, raw_request))

        for path in ("/v1/score", "/score"):
            app.post(path, response_model=ScoreResponse, responses=_ERRORS)(score)
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            app.post(path, response_model=RerankResponse, responses=_ERRORS)(rerank)


def _respond(result):
    if hasattr(result, "__aiter__"):
        return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return JSONResponse(result.model_dump())
