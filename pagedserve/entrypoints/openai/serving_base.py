"""What the completion and chat handlers share: model checks, admission, disconnects, streams, usage."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import Request

from pagedserve.engine.async_llm import AsyncLLM, QueueFullError, RequestEndedError
from pagedserve.engine.core_client import EngineDeadError
from pagedserve.entrypoints.openai.errors import APIError, error_type, request_id_of
from pagedserve.entrypoints.openai.protocol import UsageInfo
from pagedserve.entrypoints.openai.serving_models import ServingModels
from pagedserve.lora_request import LoRARequest
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.structured_output.grammar_compiler import StructureError

logger = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.5
# Why a request ended without its output, when the server, not the request, is the cause: 503s.
_SERVER_ENDED = (EngineDeadError, RequestEndedError)


# What the API reports for a logprob of -inf.
LOWEST_LOGPROB = -9999.0


class ServingBase:
    def __init__(self, engine: AsyncLLM, models: ServingModels, max_n: int) -> None:
        self.engine = engine
        self.models = models
        self.tokenizer = engine.tokenizer
        self.max_n = max_n
        # What a request leaves out: the model's generation defaults, but for max_tokens, which the front end caps
        # (FrontEnd.cap_unrequested_tokens) rather than sets.
        self.default_params = dataclasses.replace(engine.front_end.default_sampling_params(), max_tokens=None)
        self._token_texts: dict[int, str] = {}

    @staticmethod
    def api_logprob(logprob: float) -> float:
        """A logprob as the API reports it: a token the request's structure or filters ruled out has -inf, which JSON
        cannot carry, so it is reported as LOWEST_LOGPROB (as vLLM does)."""
        return max(logprob, LOWEST_LOGPROB)

    def token_text(self, token_id: int) -> str:
        """A token's text decoded alone, as logprobs show it. Cached (a vocabulary's worth at most): an echoed long
        prompt's logprobs name tens of thousands of tokens, decoded on the event loop."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter the request's model names (None: the base model); 404 for a model not served here."""
        return self.models.resolve(model)

    def check_n(self, n: int) -> None:
        if n > self.max_n:
            raise APIError(400, f"n must be <= {self.max_n} (this server's limit of samples per request), got {n}", param="n")

    async def add_requests(self, request_id: str, prompts: list, params: SamplingParams, stream: bool, priority: int,
                           structure_field: str | None = None, lora_request: LoRARequest | None = None,
                           prompt_field: str | None = None):
        """Admit every prompt or none: -> [(sub-request id, queue)]. structure_field: the request field that gave the
        output's structure (the one a structure that does not compile is blamed on); prompt_field: the field a bad
        prompt is blamed on, where only the prompts can be at fault."""
        self.check_n(params.n)
        if params.kv_transfer_params and params.kv_transfer_params.get("do_remote_decode"):
            if stream:
                raise APIError(400, "kv_transfer_params.do_remote_decode answers once, with the KV's whereabouts: stream must be false",
                               param="kv_transfer_params")
            if len(prompts) > 1:
                raise APIError(400, "kv_transfer_params.do_remote_decode holds one prompt's KV: give one prompt",
                               param="kv_transfer_params")
        params.output_kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        added = []
        try:
            for index, prompt in enumerate(prompts):
                sub_id = f"{request_id}-{index}"
                added.append((sub_id, await self.engine.add_request(prompt, params, sub_id, priority, lora_request)))
        except Exception as exc:
            for sub_id, _ in added:
                await self.engine.abort(sub_id)
            raise _as_api_error(exc, structure_field, prompt_field) from exc
        return added

    async def sse_stream(self, added, events: AsyncIterator[str], raw_request: Request,
                         error_event: Callable[[int, str], str] | None = None) -> AsyncIterator[str]:
        """SSE framing shared by the endpoints: the events, an error event if generation fails (error_event's, given
        the status and message, where the endpoint's API has its own; then the stream ends there), else [DONE] last.
        However the stream ends (a client that went away included), the sub-requests are aborted; that is a no-op for
        finished ones."""
        try:
            async for event in events:
                yield event
        except Exception as exc:
            status, message = stream_failure(exc, request_id_of(raw_request))
            if error_event is not None:
                yield error_event(status, message)
                return
            yield sse({"error": {"message": message, "type": error_type(status), "param": None, "code": status}})
        finally:
            await events.aclose()
            for sub_id, _ in added:
                await self.engine.abort(sub_id)
        if error_event is None:
            yield sse("[DONE]")

    def streams(self, added) -> list[AsyncIterator[RequestOutput]]:
        return [self.engine.iterate(sub_id, queue) for sub_id, queue in added]

    async def collect_final(self, added, raw_request: Request | None) -> list[RequestOutput]:
        """Non-streaming: each prompt's final output, aborting everything if the client goes away (with no request, as
        for a response run in the background, it runs on without one)."""

        async def collect():
            finals = []
            for stream in self.streams(added):
                async for output in stream:
                    final = output
                finals.append(final)
            return finals

        task = asyncio.ensure_future(collect())
        while not task.done():
            await asyncio.wait([task], timeout=_DISCONNECT_POLL_S)
            if not task.done() and raw_request is not None and await raw_request.is_disconnected():
                task.cancel()
                for sub_id, _ in added:
                    await self.engine.abort(sub_id)
                raise asyncio.CancelledError
        try:
            return task.result()
        except _SERVER_ENDED as exc:
            raise APIError(503, str(exc)) from exc


def _as_api_error(exc: Exception, structure_field: str | None = None, prompt_field: str | None = None) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, StructureError):
        return APIError(400, str(exc), param=structure_field or exc.field)
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc))
    if isinstance(exc, _SERVER_ENDED):
        return APIError(503, "the engine is not running" if isinstance(exc, EngineDeadError) else str(exc))
    if isinstance(exc, (ValueError, TypeError)):
        return APIError.bad_request(exc, param=prompt_field)
    raise exc


async def merge_streams(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Interleave several async iterators as items arrive: yields (stream index, item)."""
    if len(streams) == 1:  # the usual request: read it in place, without a task and a queue in between per item
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index, stream):
        try:
            async for item in stream:
                await queue.put((index, item))
        except Exception as exc:
            await queue.put((index, exc))
        finally:
            await queue.put((index, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
                continue
            if isinstance(item, Exception):
                raise item
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


def prompt_list(prompt, field: str) -> list:
    """A request's prompts (a text, texts, token ids or lists of them) as a list of prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, f"{field} must not be empty", param=field)
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def usage_of(outputs: list[RequestOutput]) -> UsageInfo:
    return make_usage(sum(len(o.prompt_token_ids) for o in outputs), sum(len(c.token_ids) for o in outputs for c in o.outputs))


def make_usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens)


def sse(payload: str | dict) -> str:
    """One SSE event: payload as JSON text already (a chunk's model_dump_json: pydantic-core's encoder, many times the
    speed of json.dumps of its model_dump), or a dict to encode."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def stream_failure(exc: Exception, request_id: str) -> tuple[int, str]:
    """Why a stream failed, as its last event tells it (status, message): what the client may know, never internal
    text."""
    if isinstance(exc, APIError):
        return exc.status, exc.message
    if isinstance(exc, _SERVER_ENDED):
        return 503, str(exc)
    logger.error("stream of request %s failed", request_id, exc_info=exc)
    return 500, f"internal server error (request id {request_id}); the server log has the details"
