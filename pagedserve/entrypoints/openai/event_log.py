"""The events of a streamed background response, kept in order so that any client can read them from any point: the
one that asked for the response, and later ones that resume its stream (GET /v1/responses/{id}?stream=true
&starting_after=N) while it runs and after it ended. An event's index is its sequence number."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


class EventLog:
    def __init__(self) -> None:
        self._events: list[str] = []
        self._closed = False
        self._changed = asyncio.Event()  # set, and replaced, whenever an event comes or the log closes

    def append(self, event: str) -> None:
        self._events.append(event)
        self._wake()

    def close(self) -> None:
        """No more events: the response ended (or was cancelled); readers end once they have read everything."""
        self._closed = True
        self._wake()

    async def read(self, start: int) -> AsyncIterator[str]:
        """The events from index start on, those to come included, until the log closes."""
        index = start
        while True:
            changed = self._changed
            while index < len(self._events):
                yield self._events[index]
                index += 1
            if self._closed:
                return
            await changed.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
