"""`pagedserve proxy`: one OpenAI-compatible front door over prefill instances and decode instances (each a
`pagedserve serve --kv-transfer-config` with a P2pConnector).

A completion or chat request goes first to a prefill instance, as itself but for one token, one sample, no stream,
and kv_transfer_params asking it to hold the prompt's KV; then, with the kv_transfer_params that instance answered,
as itself to a decode instance, whose answer (a stream or not) goes back to the client unchanged. Both legs carry the
client's X-Request-Id (or one made here). Each leg goes to the instance of its kind with the fewest requests in flight
from this proxy. A client that goes away ends the leg in flight (its instance then aborts the request). An error of
an instance comes back as it is; an instance that cannot be reached is a 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from contextlib import asynccontextmanager

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.entrypoints.openai.errors import error_response

logger = logging.getLogger(__name__)

_LEG_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10)
_DISCONNECT_POLL_S = 0.05


class Instances:
    """Instances of one kind, each with its requests in flight from this proxy."""

    def __init__(self, urls: list[str]) -> None:
        self.in_flight = {url.rstrip("/"): 0 for url in urls}

    def least_loaded(self) -> str:
        return min(self.in_flight, key=self.in_flight.get)


def prefill_body(body: dict) -> dict:
    """The request as the prefill instance runs it: its prompt, one token, one sample, no stream, its KV held."""
    prefill = {key: value for key, value in body.items() if key not in ("stream", "stream_options", "min_tokens", "n", "best_of")}
    if "max_completion_tokens" in body:
        prefill["max_completion_tokens"] = 1
    else:
        prefill["max_tokens"] = 1
    prefill["kv_transfer_params"] = {"do_remote_decode": True}
    return prefill


def build_app(prefill_urls: list[str], decode_urls: list[str]) -> FastAPI:
    prefill, decode = Instances(prefill_urls), Instances(decode_urls)
    state: dict[str, aiohttp.ClientSession] = {}

    @asynccontextmanager
    async def lifespan(_app):
        state["session"] = aiohttp.ClientSession(timeout=_LEG_TIMEOUT)
        yield
        await state["session"].close()

    app = FastAPI(title="pagedserve proxy", lifespan=lifespan)

    async def relay(request: Request, path: str):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error_response(400, f"malformed JSON body: {exc}")
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object")
        headers = _leg_headers(request)
        if _several_prompts(body):  # one kv_transfer_params answers one prompt: the decode instance computes them all
            return await _decode(request, state["session"], decode, path, body, headers)
        first = await _until_disconnected(request, _prefill_leg(state["session"], prefill, path, body, headers))
        if first is None:
            return Response(status_code=499)  # the client went away; the prefill instance aborted its leg
        if isinstance(first, Response):
            return first
        return await _decode(request, state["session"], decode, path, body | {"kv_transfer_params": first}, headers)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await relay(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await relay(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request):
        url = decode.least_loaded()
        try:
            async with state["session"].get(url + "/v1/models", headers=_leg_headers(request)) as response:
                return Response(await response.read(), status_code=response.status, media_type=response.content_type)
        except aiohttp.ClientError as exc:
            return _unreachable(url, exc)

    @app.get("/health")
    async def health():
        """200 when every instance answers its /health with 200; otherwise 503 naming those that do not."""
        urls = [*prefill.in_flight, *decode.in_flight]
        statuses = await asyncio.gather(*(_health_of(state["session"], url) for url in urls))
        down = [url for url, ok in zip(urls, statuses) if not ok]
        if down:
            return error_response(503, f"instances not healthy: {', '.join(down)}")
        return Response(status_code=200)

    return app


async def _decode(request: Request, session: aiohttp.ClientSession, decode: Instances, path: str, body: dict, headers: dict):
    if body.get("stream"):
        return await _decode_stream(session, decode, path, body, headers)
    answer = await _until_disconnected(request, _decode_whole(session, decode, path, body, headers))
    return Response(status_code=499) if answer is None else answer


def _several_prompts(body: dict) -> bool:
    prompt = body.get("prompt")
    return isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(item, int) for item in prompt)


async def _health_of(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as response:
            return response.status == 200
    except (TimeoutError, aiohttp.ClientError):
        return False


def _leg_headers(request: Request) -> dict[str, str]:
    headers = {"X-Request-Id": request.headers.get("x-request-id") or uuid.uuid4().hex}
    if "authorization" in request.headers:
        headers["Authorization"] = request.headers["authorization"]
    return headers


async def _until_disconnected(request: Request, leg):
    """The leg's result, or None (the leg cancelled) once the client has gone away."""
    task = asyncio.ensure_future(leg)
    while not task.done():
        await asyncio.wait([task], timeout=_DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            return None
    return task.result()


async def _prefill_leg(session: aiohttp.ClientSession, prefill: Instances, path: str, body: dict, headers: dict):
    """The prefill instance's kv_transfer_params, or the Response to give the client (its error)."""
    url = prefill.least_loaded()
    prefill.in_flight[url] += 1
    try:
        async with session.post(url + path, json=prefill_body(body), headers=headers) as response:
            if response.status != 200:
                return Response(await response.read(), status_code=response.status, media_type=response.content_type)
            answer = await response.json()
    except aiohttp.ClientError as exc:
        return _unreachable(url, exc)
    finally:
        prefill.in_flight[url] -= 1
    params = answer.get("kv_transfer_params")
    if not isinstance(params, dict):
        return error_response(503, f"the prefill instance {url} answered without kv_transfer_params: is it serving with "
                                   "--kv-transfer-config naming the P2pConnector (kv_role kv_producer or kv_both)?")
    return params


async def _decode_whole(session: aiohttp.ClientSession, decode: Instances, path: str, body: dict, headers: dict) -> Response:
    url = decode.least_loaded()
    decode.in_flight[url] += 1
    try:
        async with session.post(url + path, json=body, headers=headers) as response:
            return Response(await response.read(), status_code=response.status, media_type=response.content_type)
    except aiohttp.ClientError as exc:
        return _unreachable(url, exc)
    finally:
        decode.in_flight[url] -= 1


async def _decode_stream(session: aiohttp.ClientSession, decode: Instances, path: str, body: dict, headers: dict) -> Response:
    url = decode.least_loaded()
    decode.in_flight[url] += 1
    try:
        response = await session.post(url + path, json=body, headers=headers)
    except aiohttp.ClientError as exc:
        decode.in_flight[url] -= 1
        return _unreachable(url, exc)
    if response.status != 200:
        try:
            return Response(await response.read(), status_code=response.status, media_type=response.content_type)
        finally:
            response.release()
            decode.in_flight[url] -= 1

    async def chunks():
        # Closing the response when the client goes away (the generator is closed) ends the decode instance's leg.
        try:
            async for chunk in response.content.iter_any():
                yield chunk
        finally:
            response.close()
            decode.in_flight[url] -= 1

    return StreamingResponse(chunks(), status_code=200, media_type=response.content_type,
                             headers={"X-Request-Id": headers["X-Request-Id"]})


def _unreachable(url: str, exc: Exception) -> JSONResponse:
    logger.warning("instance %s could not be reached: %s", url, exc)
    return error_response(503, f"the instance {url} could not be reached: {exc}")
