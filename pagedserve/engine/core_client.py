"""EngineCoreClient: the front end's handle on an engine core, in this process or in its own.

InprocClient runs the EngineCore here, a step per get_output() (the offline LLM). AsyncMPClient
starts the engine-core process and talks to it over ZMQ (the server); it alone watches that
process, so a core that dies is noticed whether or not a request is in flight.
"""

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
from pagedserve.engine.core_proc import run_engine_core
from pagedserve.engine.output_reader import OutputReader
from pagedserve.engine.wire import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineFailed,
    ModelLocated,
    RequestType,
    UtilityResult,
    decode_output,
    encode_request,
)
from pagedserve.model_info import ModelInfo
from pagedserve.processes import UNGUARDED_MAIN_EXIT_CODE, UNGUARDED_MAIN_MESSAGE, describe_exit, exit_if_reimporting_main

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class EngineCoreClient:
    """LLMEngine uses the synchronous calls, AsyncLLM the asynchronous ones; a client implements the
    kind its front end needs."""

    model_info: ModelInfo

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        raise NotImplementedError

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError

    def call_utility(self, method: str, *args):
        raise NotImplementedError

    async def add_requests_async(self, requests: list[EngineCoreRequest]) -> None:
        raise NotImplementedError

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    async def get_output_async(self) -> EngineCoreOutputs:
        raise NotImplementedError

    async def call_utility_async(self, method: str, *args):
        raise NotImplementedError

    async def call_utility_on_each_async(self, method: str, *args) -> list:
        """The call's result from each engine core, in their order (one here)."""
        return [await self.call_utility_async(method, *args)]

    def is_alive(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass


class InprocClient(EngineCoreClient):
    """The engine core in this process: get_output() runs one step."""

    def __init__(self, config: EngineConfig) -> None:
        from pagedserve.engine.core import EngineCore  # loads torch: only clients that run the core here need it

        self.engine_core = EngineCore(config)
        self.model_info = self.engine_core.model_info

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        for request in requests:
            self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return EngineCoreOutputs(self.engine_core.step(), self.engine_core.get_stats(), self.engine_core.last_step)

    def call_utility(self, method: str, *args):
        return self.engine_core.call_utility(method, *args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class AsyncMPClient(EngineCoreClient):
    """The engine core in a process of its own (spawned), over ZMQ; asyncio calls."""

    def __init__(self, config: EngineConfig, startup_timeout_s: float = 600.0, while_starting=None, wait: bool = True,
                 on_model_located=None) -> None:
        """Start the engine core and wait until it is ready (unless not wait: then wait_ready() later); see
        wait_ready for the callbacks."""
        exit_if_reimporting_main()
        self._ipc_dir = tempfile.mkdtemp(prefix="pagedserve-")
        input_address = f"ipc://{self._ipc_dir}/input"
        output_address = f"ipc://{self._ipc_dir}/output"
        self.context = zmq.asyncio.Context()
        self.input_socket = self.context.socket(zmq.PUSH)
        self.input_socket.bind(input_address)
        self.output_socket = self.context.socket(zmq.PULL)
        self.output_socket.bind(output_address)
        spawn = multiprocessing.get_context("spawn")
        # A daemonic process may not start children: an engine core with worker processes of its own is not one
        # (it stops with its parent all the same: see core_proc.py).
        self.process = spawn.Process(target=run_engine_core, args=(config, input_address, output_address, os.getpid()),
                                     name="EngineCore", daemon=config.world_size == 1)
        self.process.start()
        self._output_reader = OutputReader(zmq.Socket.shadow(self.output_socket.underlying), self.process.sentinel)
        self.dead = False
        self._utility_ids = itertools.count()
        self._utility_futures: dict[int, asyncio.Future] = {}
        self.startup_timeout_s = startup_timeout_s
        if wait:
            self.wait_ready(while_starting, on_model_located)

    def wait_ready(self, while_starting=None, on_model_located=None) -> None:
        """while_starting(): work of this process's own meanwhile; on_model_located(model_dir): called when the core has
        found the model's files, while it loads them."""
        try:
            if while_starting is not None:
                while_starting()
            self.model_info = self._wait_ready(self.startup_timeout_s, on_model_located)
        except BaseException:  # a signal or a failed start: leave no process behind
            self.shutdown()
            raise

    def _wait_ready(self, timeout_s: float, on_model_located=None) -> ModelInfo:
        """Block until the core reports ready; fail fast if it dies or reports an error."""
        sync_socket = zmq.Socket.shadow(self.output_socket.underlying)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sync_socket.poll(500):
                message = decode_output(sync_socket.recv())
                if isinstance(message, EngineFailed):
                    raise RuntimeError(f"engine core failed to start: {message.error}")
                if isinstance(message, ModelLocated):
                    if on_model_located is not None:
                        on_model_located(message.model_dir)
                    continue
                return message.model_info
            if self.process.exitcode == UNGUARDED_MAIN_EXIT_CODE:
                raise RuntimeError(UNGUARDED_MAIN_MESSAGE.format(reason="the engine core always runs in a process of its own"))
            if not self.process.is_alive():
                raise RuntimeError(f"engine core process exited during start-up ({describe_exit(self.process)})")
        raise RuntimeError(f"engine core was not ready within {timeout_s:.0f} s")

    def is_alive(self) -> bool:
        return not self.dead and self.process.is_alive()

    def exit_code(self) -> int | None:
        return self.process.exitcode

    async def add_requests_async(self, requests: list[EngineCoreRequest]) -> None:
        self._check_alive()
        for request in requests:
            await self.input_socket.send(encode_request(RequestType.ADD, request))

    async def wake_async(self) -> None:
        if self.is_alive():
            await self.input_socket.send(encode_request(RequestType.WAKE, None))

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and self.is_alive():
            await self.input_socket.send(encode_request(RequestType.ABORT, list(request_ids)))

    async def call_utility_async(self, method: str, *args):
        self._check_alive()
        call_id = next(self._utility_ids)
        future = self._utility_futures[call_id] = asyncio.get_running_loop().create_future()
        await self.input_socket.send(encode_request(RequestType.UTILITY, (call_id, method, list(args))))
        return await future

    async def get_output_async(self) -> EngineCoreOutputs:
        """Next step's outputs; utility replies are routed to their callers on the way. Raises
        EngineDeadError as soon as the engine process exits (its sentinel is watched beside the socket)."""
        while True:
            frame = await self._output_reader.next_frame()
            if frame is None:
                self.dead = True
                self._fail_utilities()
                raise EngineDeadError(f"engine core process died ({describe_exit(self.process)})")
            message = decode_output(frame)
            if isinstance(message, UtilityResult):
                self._resolve_utility(message)
                continue
            return message

    def _resolve_utility(self, message: UtilityResult) -> None:
        future = self._utility_futures.pop(message.call_id, None)
        if future is None or future.done():
            return
        if message.error:
            future.set_exception(ValueError(message.error) if message.bad_input else RuntimeError(message.error))
        else:
            future.set_result(message.result)

    def _fail_utilities(self) -> None:
        for future in self._utility_futures.values():
            if not future.done():
                future.set_exception(EngineDeadError("the engine core process died"))
        self._utility_futures.clear()

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
        self._output_reader.stop()
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
