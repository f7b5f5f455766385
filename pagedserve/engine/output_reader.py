"""The engine core's messages as the front end's event loop receives them.

A step's outputs arrive once a step, and the front end waits for them beside the core process's exit. The loop
watches both file descriptors for as long as the core runs, and each wait is one future: a poller and a receive
of zmq.asyncio per step set up and tear down their watches every time, work that a decode step of one stream pays
in full, on the cores the engine's step runs on.
"""

from __future__ import annotations

import asyncio
import collections

import zmq


class OutputReader:
    """Messages from socket (a plain PULL socket) in arrival order, until the process whose sentinel is given exits;
    read on the running loop (the one of the first wait; a later loop takes the watches over)."""

    def __init__(self, socket: zmq.Socket, sentinel: int) -> None:
        self._socket = socket
        self._sentinel = sentinel
        self._frames: collections.deque[bytes] = collections.deque()
        self._exited = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future | None = None

    async def next_frame(self) -> bytes | None:
        """The next message; None once none is left and the process has exited."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._watch(loop)
        while not self._frames:
            if self._exited:
                return None
            self._waiter = loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._frames.popleft()

    def stop(self) -> None:
        """Stop watching (before the socket closes)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._socket.FD)
            self._loop.remove_reader(self._sentinel)
        self._loop = None

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        self.stop()
        self._loop = loop
        loop.add_reader(self._socket.FD, self._receive)
        if not self._exited:
            loop.add_reader(self._sentinel, self._on_exit)
        self._receive()  # what came before the watch: the socket's descriptor signals changes, not their presence

    def _receive(self) -> None:
        # ZMQ's descriptor says only that the socket's state may have changed: the socket is read until empty.
        while self._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._frames.append(self._socket.recv(zmq.NOBLOCK))
        self._wake()

    def _on_exit(self) -> None:
        self._loop.remove_reader(self._sentinel)
        self._receive()  # what it sent before it exited comes first
        self._exited = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done() and (self._frames or self._exited):
            self._waiter.set_result(None)
