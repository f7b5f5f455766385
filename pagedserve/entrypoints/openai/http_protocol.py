"""uvicorn's HTTP/1.1 protocol with a deadline for each request's head. uvicorn bounds the idle time between one
response and the next request, but not the time a client takes to send a request's line and headers: a client that
opens connections and sends nothing, or a byte at a time, would hold them forever. Here a head not complete within
the deadline (from the connection's start, or from the last response) is answered 408 and the connection closed.
(The body's pace is bounded by the middleware, openai/middleware.py.)"""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedserve.entrypoints.openai.errors import error_response


def protocol_with_head_deadline(seconds: float) -> type[H11Protocol]:
    class HeadDeadlineProtocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_deadline = None
            self._arm_head_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_deadline()

        def connection_lost(self, exc) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
            super().connection_lost(exc)

        def _arm_head_deadline(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
            self._head_deadline = self.loop.call_later(seconds, self._on_head_deadline)

        def _on_head_deadline(self) -> None:
            waiting_for_head = (self.cycle is None or self.cycle.response_complete) and self.conn.their_state is not h11.SEND_BODY
            if waiting_for_head and not self.transport.is_closing():
                self.transport.write(_timeout_response(seconds))
                self.transport.close()

    return HeadDeadlineProtocol


def _timeout_response(seconds: float) -> bytes:
    """The 408 as raw bytes: no request was parsed, so none of uvicorn's response machinery applies."""
    body = error_response(408, f"the request's line and headers did not arrive within {seconds:g} s").body
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body
