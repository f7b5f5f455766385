"""uvicorn's HTTP/1.1 protocol with the bounds a server facing untrusted clients needs at the connection level:

- a deadline for each request's head. uvicorn bounds the idle time between one response and the next request, but not
  the time a client takes to send a request's line and headers: a client that opens connections and sends nothing, or
  a byte at a time, would hold them forever. A head not complete within the deadline (from the connection's start, or
  from the last response) is answered 408 and the connection closed. (The body's pace is bounded by the middleware,
  openai/middleware.py.)
- a bound on open connections: each one holds a file descriptor and buffers, whether or not its requests reach the
  engine. A connection beyond the bound is answered 503 when its request arrives, and closed.

Both answers are written as raw bytes with an OpenAI-style body: no request was handed to the app, so none of its
response machinery applies."""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedserve.entrypoints.openai.errors import error_response


def bounded_protocol(head_deadline_s: float, max_connections: int) -> type[H11Protocol]:
    class BoundedProtocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_deadline = None
            self._over_capacity = len(self.connections) > max_connections  # this one counted
            if not self._over_capacity:
                self._arm_head_deadline()

        def data_received(self, data: bytes) -> None:
            if self._over_capacity:
                self._answer_and_close(503, f"the server has {max_connections} connections open, its limit; retry later")
                return
            super().data_received(data)

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
            self._head_deadline = self.loop.call_later(head_deadline_s, self._on_head_deadline)

        def _on_head_deadline(self) -> None:
            waiting_for_head = (self.cycle is None or self.cycle.response_complete) and self.conn.their_state is not h11.SEND_BODY
            if waiting_for_head:
                self._answer_and_close(408, f"the request's line and headers did not arrive within {head_deadline_s:g} s")

        def _answer_and_close(self, status: int, message: str) -> None:
            if not self.transport.is_closing():
                self.transport.write(_raw_error(status, message))
                self.transport.close()

    return BoundedProtocol


_REASONS = {408: "Request Timeout", 503: "Service Unavailable"}


def _raw_error(status: int, message: str) -> bytes:
    body = error_response(status, message).body
    head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode() + body
