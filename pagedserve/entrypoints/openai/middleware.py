"""What wraps every route: a request id, the API key, the body size limit, and refusing new work
while the server drains. Plain ASGI where the body is concerned, so a body over the limit is refused
as it arrives, before it is read whole."""

from __future__ import annotations

import logging
import secrets
import uuid

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException

from pagedserve.entrypoints.openai.errors import error_response, internal_error_response
from pagedserve.entrypoints.openai.settings import ServerSettings

logger = logging.getLogger(__name__)

# Routes anyone may reach: load balancers and probes have no key.
_OPEN_ROUTES = ("/health",)


def install_middleware(app: FastAPI, settings: ServerSettings, is_draining) -> None:
    """is_draining(): True once the server stops taking new requests."""
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)
    if settings.api_key:
        _install_auth(app, settings.api_key, open_routes=_OPEN_ROUTES + (() if settings.metrics_require_api_key else ("/metrics",)))

    @app.middleware("http")
    async def refuse_while_draining(request: Request, call_next):
        if is_draining() and request.url.path != "/health":
            return error_response(503, "the server is shutting down")
        return await call_next(request)

    @app.middleware("http")
    async def request_id(request: Request, call_next):
        # Outermost (added last): every response carries the id the log uses, and an unexpected error is
        # logged here once, with its traceback, and answered with a 500 that names only the id.
        request_id = request.state.request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            response = await call_next(request)
        except Exception as exc:
            logger.error("unhandled error in request %s", request_id, exc_info=exc)
            response = internal_error_response(request_id)
        response.headers["x-request-id"] = request_id
        return response


def _install_auth(app: FastAPI, api_key: str, open_routes: tuple[str, ...]) -> None:
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if request.url.path not in open_routes:
            given = request.headers.get("authorization", "").encode()
            if not secrets.compare_digest(given, expected):  # constant time: no timing hint at the key
                return error_response(401, "invalid or missing API key (send 'Authorization: Bearer <key>')")
        return await call_next(request)


class BodySizeLimit:
    """413 for a request body over max_bytes: by its Content-Length when it has one, else as it streams in."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, self._message())  # the route's body parsing passes it on as it is
            return message

        await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return f"the request body is larger than this server's limit of {self.max_bytes} bytes (--max-request-bytes)"

    async def _refuse(self, scope, receive, send):
        await error_response(413, self._message())(scope, receive, send)
