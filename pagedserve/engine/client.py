"""EngineCoreClient for the online server: starts the engine-core process and talks to it over ZMQ."""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import tempfile
import time

import zmq
import zmq.asyncio

from pagedserve.config import EngineConfig
from pagedserve.core.interface import EngineCoreOutputs, EngineCoreRequest
from pagedserve.engine.core_proc import run_engine_core
from pagedserve.engine.messages import (
    EngineFailed,
    EngineReady,
    RequestType,
    UtilityResult,
    decode_output,
    encode_request,
)

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class AsyncMPClient:
    """Front-end side of the engine core process."""

    def __init__(self, config: EngineConfig, startup_timeout_s: float = 600.0, while_starting=None) -> None:
        """Start the engine core and wait until it is ready; while_starting() runs meanwhile in this process."""
        self._ipc_dir = tempfile.mkdtemp(prefix="pagedserve-")
        input_address = f"ipc://{self._ipc_dir}/input"
        output_address = f"ipc://{self._ipc_dir}/output"
        self.context = zmq.asyncio.Context()
        self.input_socket = self.context.socket(zmq.PUSH)
        self.input_socket.bind(input_address)
        self.output_socket = self.context.socket(zmq.PULL)
        self.output_socket.bind(output_address)
        spawn = multiprocessing.get_context("spawn")
        self.process = spawn.Process(
            target=run_engine_core, args=(config, input_address, output_address, os.getpid()), name="EngineCore", daemon=True
        )
        self.process.start()
        self.dead = False
        self._utility_ids = itertools.count()
        self._utility_futures: dict[int, asyncio.Future] = {}
        try:
            if while_starting is not None:
                while_starting()
            self.ready: EngineReady = self._wait_ready(startup_timeout_s)
        except BaseException:  # a signal or a failed start: leave no process behind
            self.shutdown()
            raise

    def _wait_ready(self, timeout_s: float) -> EngineReady:
        """Block until the core reports ready; fail fast if it dies or reports an error."""
        sync_socket = zmq.Socket.shadow(self.output_socket.underlying)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sync_socket.poll(500):
                message = decode_output(sync_socket.recv())
                if isinstance(message, EngineFailed):
                    raise RuntimeError(f"engine core failed to start: {message.error}")
                return message
            if not self.process.is_alive():
                raise RuntimeError(f"engine core process exited during start-up (exit code {self.process.exitcode})")
        raise RuntimeError(f"engine core was not ready within {timeout_s:.0f} s")

    def is_alive(self) -> bool:
        return not self.dead and self.process.is_alive()

    async def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._check_alive()
        for request in requests:
            await self.input_socket.send(encode_request(RequestType.ADD, request))

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.is_alive():
            await self.input_socket.send(encode_request(RequestType.ABORT, list(request_ids)))

    async def call_utility(self, method: str, *args):
        self._check_alive()
        call_id = next(self._utility_ids)
        future = self._utility_futures[call_id] = asyncio.get_running_loop().create_future()
        await self.input_socket.send(encode_request(RequestType.UTILITY, (call_id, method, list(args))))
        return await future

    async def get_output(self) -> EngineCoreOutputs:
        """Next step's outputs; utility replies are routed to their callers on the way."""
        while True:
            while not await self.output_socket.poll(500):
                if not self.process.is_alive():
                    self.dead = True
                    raise EngineDeadError(f"engine core process died (exit code {self.process.exitcode})")
            message = decode_output(await self.output_socket.recv())
            if isinstance(message, UtilityResult):
                self._resolve_utility(message)
                continue
            return message

    def _resolve_utility(self, message: UtilityResult) -> None:
        future = self._utility_futures.pop(message.call_id, None)
        if future is None or future.done():
            return
        if message.error:
            future.set_exception(RuntimeError(message.error))
        else:
            future.set_result(message.result)

    def _check_alive(self) -> None:
        if not self.is_alive():
            raise EngineDeadError("the engine core process is not running")

    def shutdown(self, timeout_s: float = 5.0) -> None:
        if self.context.closed:
            return
        if self.process.is_alive():
            try:
                sync_socket = zmq.Socket.shadow(self.input_socket.underlying)
                sync_socket.send(encode_request(RequestType.SHUTDOWN, None), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(2)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.context.term()
        for name in ("input", "output"):
            try:
                os.unlink(os.path.join(self._ipc_dir, name))
            except FileNotFoundError:
                pass
        try:
            os.rmdir(self._ipc_dir)
        except OSError:
            pass
