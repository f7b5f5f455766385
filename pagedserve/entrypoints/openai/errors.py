"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from pagedserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}
# Engine validation messages start with the field they are about: "top_p must be in (0, 1], got 2".
_FIELD_MESSAGE = re.compile(r"^([a-z_]+) must be")


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


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=_TYPES.get(status, "invalid_request_error"), param=param,
                                         code=code if code is not None else status))
    return JSONResponse(body.model_dump(), status_code=status)


def api_error_response(exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param, exc.code)
