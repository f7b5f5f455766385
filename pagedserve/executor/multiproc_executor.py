"""The executor of a tensor- and pipeline-parallel engine: one worker process per rank, a torch.distributed
process group among them (gloo on CPU, NCCL on CUDA). Workers start by fork where that is safe, so a plain script
needs no `if __name__ == "__main__":` guard; by spawn otherwise (processes.child_start_method), where a script
without the guard gets one error that says to add it.

Each step's scheduler output is encoded once (rank_messages.py) and written once into a ring in shared
memory that every rank reads (shm_ring.py; each rank's ZMQ socket is the ring's side channel, for wake-ups
and messages too long for a slot); every rank runs its share of the step, the ranks exchanging activations
through torch.distributed, and the output rank (the last stage's first tensor-parallel rank) writes the step's
ModelRunnerOutput into a second ring, which the executor reads (its side channel a socket of its own). Everything
else a rank says (ready, a call's result, an error) comes back on the results socket, which the executor checks
while it waits for a step. A worker that dies fails the engine: the next wait on the workers raises
WorkerDiedError, and the remaining workers are stopped. Under pipeline parallelism up to
pipeline_parallel_size steps are in flight (submit_step / wait_step), so that the stages overlap.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
import traceback
from collections import deque

import zmq

from pagedserve import log
from pagedserve.config import EngineConfig
from pagedserve.core.contracts import ModelRunnerOutput, SchedulerOutput
from pagedserve.distributed.parallel_state import RankInfo
from pagedserve.executor import rank_messages
from pagedserve.executor.abstract import WorkerCall
from pagedserve.executor.distributed import DistributedExecutor, WorkerDiedError, WorkerProcess
from pagedserve.executor.shm_ring import RingReader, RingSpec, RingWriter, close_ring, create_ring
from pagedserve.ports import free_port
from pagedserve.processes import (
    UNGUARDED_MAIN_EXIT_CODE,
    UNGUARDED_MAIN_MESSAGE,
    child_start_method,
    describe_exit,
    exit_if_reimporting_main,
    exit_process,
    exit_with_parent,
    mark_engine_process,
)

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 900.0
# How long the executor spins for a step's output before it sleeps on the output ring's socket: a step that takes
# longer gains nothing from a spin, and a spin takes a core from the ranks.
_OUTPUT_SPIN_S = 0.0005
# How often a wait for a step's output looks for a worker's error or death.
_HEALTH_CHECK_S = 0.1


class MultiprocExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig) -> None:
        exit_if_reimporting_main()
        super().__init__(config)
        self._pending: deque[float] = deque()  # submit times of the steps in flight
        self._ipc_dir = tempfile.mkdtemp(prefix="pagedserve-workers-")
        self._start_method, self._start_reason = child_start_method()
        result_address, output_address = f"ipc://{self._ipc_dir}/results", f"ipc://{self._ipc_dir}/outputs"
        addresses = [f"ipc://{self._ipc_dir}/rank{info.rank}" for info in self.infos]
        init_method = f"tcp://127.0.0.1:{free_port()}"
        context = multiprocessing.get_context(self._start_method)
        self.processes = []
        self._ring = RingWriter(len(self.infos), readers_alive=self.check_health)
        self._codec = rank_messages.ExecutorCodec()
        # Steps in flight each have an output the executor may not have read yet.
        self._output_ring, output_ring_spec = create_ring(1, num_slots=max(4, 2 * config.pipeline_parallel_size))
        # The workers start before this process's ZMQ context exists (its I/O threads would not survive a fork); they
        # connect, and ZMQ holds their messages until the sockets below are bound.
        self.processes = [context.Process(target=run_worker, name=f"Worker-{info.rank}", daemon=True,
                                          args=(config, info, init_method, self._ring.spec, output_ring_spec, address,
                                                result_address, output_address, os.getpid()))
                          for info, address in zip(self.infos, addresses)]
        self._context = zmq.Context()
        self._results = self._context.socket(zmq.PULL)
        self._output_socket = self._context.socket(zmq.PULL)
        self._outputs = RingReader(output_ring_spec, 0, self._output_socket, spin_s=_OUTPUT_SPIN_S)
        self._inputs = []
        try:
            for process in self.processes:
                process.start()
            self._results.bind(result_address)
            self._output_socket.bind(output_address)
            for address in addresses:
                socket_ = self._context.socket(zmq.PUSH)
                socket_.bind(address)
                self._inputs.append(socket_)
            self._ring.side_channels = self._inputs
            self._collect(lambda kind: kind == "ready", len(self.infos), _STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d workers ready (tensor parallel %d x pipeline parallel %d)", len(self.infos), config.tensor_parallel_size,
                    config.pipeline_parallel_size)

    # ---- the executor interface ---------------------------------------------------------------------

    def submit_step(self, scheduler_output: SchedulerOutput) -> None:
        """Send a step to every rank and return without waiting for it."""
        self._broadcast(self._codec.encode_step(scheduler_output))
        self._pending.append(time.perf_counter())

    def wait_step(self) -> ModelRunnerOutput:
        """The output of the oldest step in flight."""
        self._pending.popleft()
        while (frame := self._outputs.recv(timeout_s=_HEALTH_CHECK_S)) is None:
            self._raise_if_a_worker_failed()
        return self._codec.decode_step_output(frame)

    def collective_rpc(self, method: WorkerCall, *args) -> list:
        self._broadcast(rank_messages.encode_call(method, args))
        return self._collect(lambda kind: kind == "call", len(self.infos))

    def check_health(self) -> None:
        for rank, process in enumerate(self.processes):
            if process.exitcode == UNGUARDED_MAIN_EXIT_CODE:
                raise RuntimeError(UNGUARDED_MAIN_MESSAGE.format(reason=self._start_reason))
            if process.pid is not None and not process.is_alive():
                raise WorkerDiedError(f"worker of rank {rank} (pid {process.pid}) ended: {describe_exit(process)}")

    def shutdown(self) -> None:
        if self._context.closed:
            return
        if self._ring.side_channels:
            self._ring.try_send(rank_messages.SHUTDOWN)  # ranks that cannot take it (gone, or stuck) are killed below
        deadline = time.monotonic() + 5
        started = [process for process in self.processes if process.pid is not None]
        for process in started:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in started:
            if process.is_alive():
                process.kill()
                process.join()
        for socket_ in (*self._inputs, self._results, self._output_socket):
            socket_.close(linger=0)
        self._context.term()
        self._ring.close()
        self._outputs.close()
        close_ring(self._output_ring)
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    # ---- messages ---------------------------------------------------------------------------------------

    def _broadcast(self, frame: bytes) -> None:
        self.check_health()
        self._ring.send(frame)  # once, whatever the number of ranks

    def _raise_if_a_worker_failed(self) -> None:
        """While a step runs, a worker speaks on the results socket only to report an error."""
        if self._results.poll(0):
            kind, rank, value = rank_messages.decode_reply(self._results.recv())
            raise RuntimeError(f"worker of rank {rank} failed: {value}" if kind == "error" else
                               f"worker of rank {rank} answered {kind!r} while a step ran")
        self.check_health()

    def _collect(self, wanted, count: int, timeout_s: float | None = None) -> list:
        """count replies of the wanted kind, in rank order; raises if a worker fails or dies meanwhile."""
        poller = zmq.Poller()
        poller.register(self._results, zmq.POLLIN)
        for process in self.processes:
            poller.register(process.sentinel, zmq.POLLIN)
        replies: dict[int, object] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(replies) < count:
            wait_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            ready = dict(poller.poll(wait_ms))
            if not ready:
                raise TimeoutError(f"workers did not answer within {timeout_s:.0f} s")
            if self._results not in ready:
                if self._results.poll(100):  # a dying worker's last word (its error) comes first
                    continue
                self.check_health()
                continue
            kind, rank, value = rank_messages.decode_reply(self._results.recv())
            if kind == "error":
                raise RuntimeError(f"worker of rank {rank} failed: {value}")
            if wanted(kind):
                replies[rank] = value
        return [replies[rank] for rank in sorted(replies)]


# ---- the worker process ------------------------------------------------------------------------------


def run_worker(config: EngineConfig, info: RankInfo, init_method: str, ring: RingSpec, output_ring: RingSpec,
               input_address: str, result_address: str, output_address: str, parent_pid: int) -> None:
    """Process entry point of one rank: its input is the step ring's side channel, the results carry replies to
    calls and errors, and the output ring's side channel is used by the output rank."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine core decides when workers stop
    signal.signal(signal.SIGTERM, lambda *_: exit_process(0))
    exit_with_parent(parent_pid)
    mark_engine_process()
    log.configure(log.FORMAT.replace("%(name)s", f"rank {info.rank} %(name)s"), force=True)  # not a forked parent's handlers
    if info.rank:  # one rank speaks for all
        logging.getLogger().setLevel(logging.WARNING)
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    results = context.socket(zmq.PUSH)
    results.connect(result_address)
    try:
        runner = WorkerProcess(config, info, init_method)
    except Exception:
        results.send(rank_messages.encode_reply("error", info.rank, traceback.format_exc()))
        results.close(linger=2000)
        exit_process(1)
    outputs = None
    if runner.rank.is_output_rank:
        output_socket = context.socket(zmq.PUSH)
        output_socket.connect(output_address)
        outputs = RingWriter(1, spec=output_ring)
        outputs.side_channels = [output_socket]
    results.send(rank_messages.encode_reply("ready", info.rank, None))
    reader = RingReader(ring, info.rank, inputs)
    serve(runner, reader, results, outputs)
    reader.close()
    if outputs is not None:
        outputs.close()
    context.destroy(linger=1000)
    exit_process(0)


def serve(rank: WorkerProcess, reader: RingReader, results, outputs: RingWriter | None) -> None:
    """Run what the executor sends until it says shutdown: steps (the output rank writes their outputs) and calls
    (every rank answers)."""
    codec = rank_messages.RankCodec()
    while True:
        kind, payload = codec.decode(reader.recv())
        if kind == "shutdown":
            return
        try:
            if kind == "step":
                output = rank.step(payload)
                if outputs is not None:
                    outputs.send(codec.encode_step_output(output))
            else:
                results.send(rank_messages.encode_reply("call", rank.rank.rank, rank.call(*payload)))
        except Exception:
            results.send(rank_messages.encode_reply("error", rank.rank.rank, traceback.format_exc()))
