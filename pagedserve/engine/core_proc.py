"""The engine core in its own process: a busy loop over ZMQ (messages: engine/wire.py)."""

from __future__ import annotations

import logging
import signal
import traceback

import zmq

from pagedserve import log
from pagedserve.config import DataParallelPlace, EngineConfig
from pagedserve.engine.wire import (
    EngineCoreOutputs,
    EngineFailed,
    EngineReady,
    ModelLocated,
    RequestType,
    UtilityResult,
    decode_request,
    encode_output,
)
from pagedserve.executor.abstract import Executor
from pagedserve.processes import exit_process, exit_with_parent, mark_engine_process

logger = logging.getLogger(__name__)

# While idle the loop blocks on the socket; this bounds how long before it notices shutdown.
_IDLE_POLL_MS = 200


def run_engine_core(config: EngineConfig, input_address: str, output_address: str, parent_pid: int) -> None:
    """Process entry point."""
    # Ctrl-C reaches the whole process group: the front end decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: exit_process(0))
    log.configure()
    exit_with_parent(parent_pid)
    mark_engine_process()
    context = zmq.Context()
    input_socket = context.socket(zmq.PULL)
    input_socket.connect(input_address)
    output_socket = context.socket(zmq.PUSH)
    output_socket.connect(output_address)
    try:
        output_socket.send(encode_output(ModelLocated(Executor.model_dir(config))))
        proc = EngineCoreProc(config, input_socket, output_socket)
    except Exception as exc:  # report why, so the front end can say it
        logger.exception("engine core failed to start")
        output_socket.send(encode_output(EngineFailed(f"{type(exc).__name__}: {exc}")))
        output_socket.close(linger=2000)
        exit_process(1)
    try:
        proc.run_busy_loop()
    except Exception:  # a step failed (a worker died, say): stop the workers, then let the front end see the exit
        logger.exception("engine core failed")
        proc.engine_core.shutdown()
        exit_process(1)
    proc.engine_core.shutdown()
    output_socket.close(linger=1000)
    input_socket.close(linger=0)
    context.term()
    logging.shutdown()
    exit_process(0)


class CoreMeeting:
    """The data-parallel cores that step together, met once per iteration of their loops: through shared memory, or,
    where /dev/shm has no room, a gloo group of their own (every core learns which from the first core's choice)."""

    def __init__(self, place: DataParallelPlace) -> None:
        import torch.distributed as dist

        from pagedserve.distributed.parallel_state import place_store, stateless_exchange, stateless_group

        store = place_store(place)
        self.shared = stateless_exchange(store, "engine-cores", place.rank, place.size)
        self.group = stateless_group(store, "engine-cores", place.rank, place.size) if self.shared is None else None
        self._max = dist.AllreduceOptions()
        self._max.reduceOp = dist.ReduceOp.MAX

    def any_of(self, busy: bool, stopping: bool) -> tuple[bool, bool]:
        """(whether any core is busy, whether any is stopping)."""
        import torch

        flags = torch.tensor([busy, stopping], dtype=torch.int32)
        if self.shared is not None:
            flags = torch.stack(self.shared.exchange(flags)).amax(dim=0)
        else:
            self.group.allreduce([flags], self._max).wait()
        return bool(flags[0]), bool(flags[1])


class EngineCoreProc:
    def __init__(self, config: EngineConfig, input_socket, output_socket) -> None:
        from pagedserve.engine.core import EngineCore

        self.engine_core = EngineCore(config)
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.running = True
        place = config.data_parallel_place
        # The other data-parallel cores this one steps with (CoreMeeting), where their ranks share a mixture's experts.
        self.meeting = CoreMeeting(place) if place is not None and self.engine_core.steps_with_other_cores else None
        self.output_socket.send(encode_output(EngineReady(self.engine_core.model_info)))

    def run_busy_loop(self) -> None:
        if self.meeting is not None:
            self._run_with_other_cores()
            return
        engine_core = self.engine_core
        while self.running:
            self._handle_inputs(block=not engine_core.has_work())
            if not self.running:
                break
            if engine_core.has_work():
                self._send_step(engine_core.step())

    def _run_with_other_cores(self) -> None:
        """Every core runs the same iterations: take its inputs, learn with the others whether any has work or is
        stopping, then all step together (a core without work here joins with an empty step) or all stop. While all
        are idle each waits for input at most _IDLE_POLL_MS before the meeting, so a message to one core (an abort, a
        utility call) reaches a meeting the others join; a new request wakes the others at once (RequestType.WAKE)."""
        engine_core, any_busy = self.engine_core, False
        while True:
            self._handle_inputs(block=not (engine_core.has_work() or any_busy))
            any_busy, any_stopping = self.meeting.any_of(engine_core.has_work(), not self.running)
            if any_stopping:
                return
            if any_busy:
                outputs = engine_core.step_with_other_cores()
                if outputs or engine_core.last_step is not None:
                    self._send_step(outputs)

    def _send_step(self, outputs) -> None:
        engine_core = self.engine_core
        self.output_socket.send(encode_output(EngineCoreOutputs(outputs, engine_core.get_stats(), engine_core.last_step)))

    def _handle_inputs(self, block: bool) -> None:
        if block and not self._wait_for_news():
            return
        while True:
            try:
                frame = self.input_socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(*decode_request(frame))

    def _wait_for_news(self) -> bool:
        """Up to _IDLE_POLL_MS for input, or for news of the KV connector (a load that ended, a hold given back);
        whether input came."""
        wake_sockets = self.engine_core.wake_sockets()
        if not wake_sockets:
            return bool(self.input_socket.poll(_IDLE_POLL_MS))
        poller = zmq.Poller()
        for socket in (self.input_socket, *wake_sockets):
            poller.register(socket, zmq.POLLIN)
        return self.input_socket in dict(poller.poll(_IDLE_POLL_MS))

    def _handle(self, kind: RequestType, payload) -> None:
        if kind == RequestType.ADD:
            try:
                self.engine_core.add_request(payload)
            except ValueError as exc:  # e.g. a duplicate id: the front end validated everything else
                logger.error("rejected request %s: %s", payload.request_id, exc)
        elif kind == RequestType.ABORT:
            self.engine_core.abort_requests(payload)
        elif kind == RequestType.UTILITY:
            call_id, method, args = payload
            try:
                result = UtilityResult(call_id, result=self.engine_core.call_utility(method, *args))
            except ValueError as exc:
                result = UtilityResult(call_id, error=str(exc), bad_input=True)
            except Exception as exc:
                result = UtilityResult(call_id, error="".join(traceback.format_exception_only(exc)).strip())
            self.output_socket.send(encode_output(result))
        elif kind == RequestType.SHUTDOWN:
            self.running = False
        # RequestType.WAKE: nothing to do; receiving it ended the wait for input
