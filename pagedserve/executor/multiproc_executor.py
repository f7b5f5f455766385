"""The executor of a tensor- and pipeline-parallel engine: one worker process per rank, a torch.distributed
process group among them (gloo on CPU, NCCL on CUDA). Workers start by fork where that is safe, so a plain script
needs no `if __name__ == "__main__":` guard; by spawn otherwise (processes.child_start_method), where a script
without the guard gets one error that says to add it.

Each step's scheduler output is pickled once and sent to every rank over a ZMQ socket of its own
(IPC); every rank runs its share of the step, the ranks exchanging activations through
torch.distributed, and the output rank (the last stage's first tensor-parallel rank) sends back the
step's ModelRunnerOutput. A worker that dies fails the engine: the next wait on the workers raises
WorkerDiedError, and the remaining workers are stopped. Under pipeline parallelism up to
pipeline_parallel_size steps are in flight (submit_step / wait_step), so that the stages overlap.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
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
from pagedserve.executor.abstract import WorkerCall
from pagedserve.executor.distributed import DistributedExecutor, WorkerDiedError, WorkerProcess, free_port
from pagedserve.processes import (
    UNGUARDED_MAIN_EXIT_CODE,
    UNGUARDED_MAIN_MESSAGE,
    child_start_method,
    exit_if_reimporting_main,
    exit_process,
    exit_with_parent,
)

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 900.0


class MultiprocExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig) -> None:
        exit_if_reimporting_main()
        super().__init__(config)
        self._pending: deque[float] = deque()  # submit times of the steps in flight
        self._ipc_dir = tempfile.mkdtemp(prefix="pagedserve-workers-")
        self._start_method, self._start_reason = child_start_method()
        result_address = f"ipc://{self._ipc_dir}/results"
        addresses = [f"ipc://{self._ipc_dir}/rank{info.rank}" for info in self.infos]
        init_method = f"tcp://127.0.0.1:{free_port()}"
        context = multiprocessing.get_context(self._start_method)
        # The workers start before this process's ZMQ context exists (its I/O threads would not survive a fork); they
        # connect, and ZMQ holds their messages until the sockets below are bound.
        self.processes = [context.Process(target=run_worker, name=f"Worker-{info.rank}", daemon=True,
                                          args=(config, info, init_method, address, result_address, os.getpid()))
                          for info, address in zip(self.infos, addresses)]
        self._context = zmq.Context()
        self._results = self._context.socket(zmq.PULL)
        self._inputs = []
        try:
            for process in self.processes:
                process.start()
            self._results.bind(result_address)
            for address in addresses:
                socket_ = self._context.socket(zmq.PUSH)
                socket_.bind(address)
                self._inputs.append(socket_)
            self._collect(lambda kind: kind == "ready", len(self.infos), _STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d workers ready (tensor parallel %d x pipeline parallel %d)", len(self.infos), config.tensor_parallel_size,
                    config.pipeline_parallel_size)

    # ---- the executor interface ---------------------------------------------------------------------

    def submit_step(self, scheduler_output: SchedulerOutput) -> None:
        """Send a step to every rank and return without waiting for it."""
        self._broadcast(("step", scheduler_output))
        self._pending.append(time.perf_counter())

    def wait_step(self) -> ModelRunnerOutput:
        """The output of the oldest step in flight."""
        self._pending.popleft()
        return self._collect(lambda kind: kind == "step", 1)[0]

    def collective_rpc(self, method: WorkerCall, *args) -> list:
        self._broadcast(("call", (method, args)))
        return self._collect(lambda kind: kind == "call", len(self.infos))

    def check_health(self) -> None:
        for rank, process in enumerate(self.processes):
            if process.exitcode == UNGUARDED_MAIN_EXIT_CODE:
                raise RuntimeError(UNGUARDED_MAIN_MESSAGE.format(reason=self._start_reason))
            if process.pid is not None and not process.is_alive():
                raise WorkerDiedError(f"worker of rank {rank} (pid {process.pid}) exited with code {process.exitcode}")

    def shutdown(self) -> None:
        if self._context.closed:
            return
        for socket_ in self._inputs:
            try:
                socket_.send(pickle.dumps(("shutdown", None)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + 5
        started = [process for process in self.processes if process.pid is not None]
        for process in started:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in started:
            if process.is_alive():
                process.kill()
                process.join()
        for socket_ in (*self._inputs, self._results):
            socket_.close(linger=0)
        self._context.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    # ---- messages ---------------------------------------------------------------------------------------

    def _broadcast(self, message) -> None:
        self.check_health()
        frame = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)  # once, whatever the number of ranks
        for socket_ in self._inputs:
            socket_.send(frame, copy=False)

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
            kind, rank, value = pickle.loads(self._results.recv())
            if kind == "error":
                raise RuntimeError(f"worker of rank {rank} failed: {value}")
            if wanted(kind):
                replies[rank] = value
        return [replies[rank] for rank in sorted(replies)]


# ---- the worker process ------------------------------------------------------------------------------


def run_worker(config: EngineConfig, info: RankInfo, init_method: str, input_address: str, result_address: str,
               parent_pid: int) -> None:
    """Process entry point of one rank."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine core decides when workers stop
    signal.signal(signal.SIGTERM, lambda *_: exit_process(0))
    exit_with_parent(parent_pid)
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
        results.send(pickle.dumps(("error", info.rank, traceback.format_exc())))
        results.close(linger=2000)
        exit_process(1)
    results.send(pickle.dumps(("ready", info.rank, None)))
    serve(runner, inputs, results)
    results.close(linger=1000)
    exit_process(0)


def serve(rank: WorkerProcess, inputs, results) -> None:
    """Run what the executor sends until it says shutdown: steps (the output rank answers) and calls (every rank)."""
    while True:
        kind, payload = pickle.loads(inputs.recv())
        if kind == "shutdown":
            return
        try:
            if kind == "step":
                output = rank.step(payload)
                if rank.rank.is_output_rank:
                    results.send(pickle.dumps(("step", rank.rank.rank, output), protocol=pickle.HIGHEST_PROTOCOL))
            else:
                results.send(pickle.dumps(("call", rank.rank.rank, rank.call(*payload)), protocol=pickle.HIGHEST_PROTOCOL))
        except Exception:
            results.send(pickle.dumps(("error", rank.rank.rank, traceback.format_exc())))
