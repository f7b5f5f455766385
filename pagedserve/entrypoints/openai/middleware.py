"""What wraps every route: a request id, the API key, the body size limit, and refusing new work
while the server drains. Plain ASGI where the body is concerned, so a body over the limit is refused
as it arrives, before it is read whole."""

from __future__ import annotations

import asyncio
import logging
import secrets
import uuid

from fastapi import FastAPI
from starlette.exceptions import HTTPException

from pagedserve.entrypoints.openai.errors import error_response, internal_error_response
from pagedserve.entrypoints.openai.settings import ServerSettings
from pagedserve.entrypoints.openai.web_console import PAGE_ROUTES

logger = logging.getLogger(__name__)

# Routes anyone may reach: load balancers and probes have no key; the web console's page asks for it.
_OPEN_ROUTES = ("/health",)


def install_middleware(app: FastAPI, settings: ServerSettings, is_draining, is_serving) -> None:
    """is_draining(): True once the server stops taking new requests; is_serving(): what /health answers (200 or 503).
    All plain ASGI: a middleware built on Starlette's BaseHTTPMiddleware would hide a client's disconnect from the
    routes, and a request whose client hung up would run on."""
    app.add_middleware(BodyLimits, max_bytes=settings.max_request_bytes, read_timeout_s=settings.request_read_timeout)
    if settings.api_key:
        open_routes = (_OPEN_ROUTES + (() if settings.metrics_require_api_key else ("/metrics",))
                       + (PAGE_ROUTES if settings.web_console else ()))
        app.add_middleware(ApiKeyCheck, api_key=settings.api_key, open_routes=open_routes)
    app.add_middleware(RefuseWhileDraining, is_draining=is_draining)
    app.add_middleware(RequestId)
    app.add_middleware(HealthProbe, is_serving=is_serving)  # added last: the outermost


class HealthProbe:
    """GET /health answered before the rest of the stack (no request id, key, body or route to look at): load balancers
    probe often, and a probe's work takes CPU from the engine beside it. 200 while serving, else 503, no body: what
    the /health route (the one the OpenAPI schema describes) answers too."""

    def __init__(self, app, is_serving) -> None:
        self.app = app
        self.is_serving = is_serving

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/health" or scope["method"] != "GET":
            return await self.app(scope, receive, send)
        await send({"type": "http.response.start", "status": 200 if self.is_serving() else 503,
                    "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})


class RequestId:
    """Every response carries the id the log uses (the client's x-request-id, else a new one); an unexpected error
    is logged here once, with its traceback, and answered with a 500 that names only the id."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers", ())).get(b"x-request-id")
        request_id = given.decode("latin-1") if given else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", request_id.encode("latin-1"))]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            logger.error("unhandled error in request %s", request_id, exc_info=exc)
            if started:  # too late for a 500: the connection just ends
                raise
            await internal_error_response(request_id)(scope, receive, send_with_id)


class RefuseWhileDraining:
    def __init__(self, app, is_draining) -> None:
        self.app = app
        self.is_draining = is_draining

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health" and self.is_draining():
            return await error_response(503, "the server is shutting down")(scope, receive, send)
        await self.app(scope, receive, send)


class ApiKeyCheck:
    """401 unless `Authorization: Bearer <key>` (the scheme's case is free, as HTTP says), on every route but the open ones."""

    def __init__(self, app, api_key: str, open_routes: tuple[str, ...]) -> None:
        self.app = app
        self.api_key = api_key.encode()
        self.open_routes = open_routes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.open_routes and not self._authorized(scope):
            return await error_response(401, "invalid or missing API key (send 'Authorization: Bearer <key>')")(scope, receive,
                                                                                                              send)
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        scheme, _, token = dict(scope.get("headers", ())).get(b"authorization", b"").partition(b" ")
        # Constant time: no timing hint at the key.
        return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.api_key)


class BodyLimits:
    """413 for a request body over max_bytes (by its Content-Length when it has one, else as it streams in); 408 for
    one that takes longer than read_timeout_s to arrive whole (a client trickling it in would hold its connection)."""

    def __init__(self, app, max_bytes: int, read_timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await error_response(413, self._too_large())(scope, receive, send)
        received = 0
        body_done = False
        deadline = asyncio.get_running_loop().time() + self.read_timeout_s

        async def limited_receive():
            nonlocal received, body_done
            if body_done:  # the routes' disconnect checks: no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except TimeoutError:
                # The route's body parsing passes these on as they are.
                raise HTTPException(408, f"the request body did not arrive within {self.read_timeout_s:g} s",
                                    headers={"connection": "close"}) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > self.max_bytes:
                    raise HTTPException(413, self._too_large())
            return message

        await self.app(scope, limited_receive, send)

    def _too_large(self) -> str:
        return f"the request body is larger than this server's limit of {self.max_bytes} bytes (--max-request-bytes)"
