"""OpenAI-style error bodies ({"error": {"message", "type", "param", "code"}}) and the handlers that
turn every failure into one. A 500 never carries internal text: it names the request id under which
the server log holds the traceback."""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from pagedserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

# The statuses whose OpenAI error type is neither of the defaults (see error_type).
_TYPES = {
    401: "authentication_error",
    503: "service_unavailable_error",
}
# Engine validation messages start with the field they are about: "top_p must be in (0, 1], got 2".
_FIELD_MESSAGE = re.compile(r"^([a-z_]+(?:\.[a-z_]+)*) must be")
# Parts of a pydantic error location that name a branch of a union, not a field.
_UNION_BRANCH = re.compile(r"^(str|int|float|bool|dict|list|none|constrained-\w+|[\w-]+-branch)$|\[.+\]")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @classmethod
    def bad_request(cls, exc: Exception, param: str | None = None) -> APIError:
        message = str(exc)
        match = _FIELD_MESSAGE.match(message)
        return cls(400, message, param=param or (match.group(1) if match else None))


def error_type(status: int) -> str:
    """The OpenAI error type of an HTTP status: the server's for a 5xx, the request's for the rest, but where _TYPES
    names one of its own."""
    return _TYPES.get(status) or ("server_error" if status >= 500 else "invalid_request_error")


def error_response(status: int, message: str, param: str | None = None, code: str | int | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=error_type(status), param=param,
                                         code=code if code is not None else status))
    return JSONResponse(body.model_dump(), status_code=status)


def internal_error_response(request_id: str) -> JSONResponse:
    return error_response(500, f"internal server error (request id {request_id}); the server log has the details")


# Where in the request a bad field was (the body, the query, the path): the field's own name says it (a query's list
# named as OpenAI's clients send it, include[], is include).
_LOCATIONS = ("body", "query", "path")


def request_id_of(request: Request) -> str:
    return getattr(request.state, "request_id", "-")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(_, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_, exc: RequestValidationError):
        errors = exc.errors()
        if any(error.get("type") == "json_invalid" for error in errors):
            return error_response(400, f"malformed JSON body: {errors[0].get('msg', '')}")
        # Of a union's failed branches, the one that got furthest says most; of those alike, one that had the right
        # type and a wrong value (-1 for a token id) says more than one that expected another type.
        first = max(errors, key=lambda error: (len(error.get("loc", ())), not error.get("type", "").endswith("_type")),
                    default={})
        location = [str(part).removesuffix("[]") for part in first.get("loc", ())
                    if part not in _LOCATIONS and not _UNION_BRANCH.search(str(part))]
        message = first.get("msg", "invalid request")
        if first.get("type") == "extra_forbidden":
            message = "not a field this server accepts (misspelled, or not supported)"
        where = ".".join(location)
        return error_response(400, f"{where}: {message}" if where else message, param=location[0] if location else None)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        response = error_response(exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})  # a 405's Allow, say
        if exc.status_code == 405:  # the router names the first route of the path only: every route's methods count
            response.headers["Allow"] = ", ".join(_methods_of(app, request.scope))
        return response

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        # The request-id middleware answers errors of the routes; this catches what fails around them.
        request_id = request_id_of(request)
        logger.error("unhandled error in request %s", request_id, exc_info=exc)
        return internal_error_response(request_id)


def _methods_of(app: FastAPI, scope) -> list[str]:
    """The methods the app's routes answer at the scope's path."""
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches(scope)
        if match != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)
