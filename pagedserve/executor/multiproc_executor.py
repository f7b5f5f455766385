"""The executor of a tensor- and pipeline-parallel engine: one worker process per rank (spawned), a
torch.distributed process group among them (gloo on CPU, NCCL on CUDA).

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
import socket
import tempfile
import time
import traceback
from collections import deque

import zmq

from pagedserve.config import EngineConfig
from pagedserve.core.contracts import ModelRunnerOutput, SchedulerOutput
from pagedserve.distributed.parallel_state import RankInfo
from pagedserve.executor.abstract import Executor, ModelInfo
from pagedserve.processes import exit_with_parent

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 900.0


class WorkerDiedError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_infos(config: EngineConfig) -> list[RankInfo]:
    partition = parse_layer_partition(config.pp_layer_partition)
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    return [RankInfo(config.tensor_parallel_size, config.pipeline_parallel_size, rank, partition) for rank in range(world)]


def parse_layer_partition(text: str | None) -> tuple[int, ...] | None:
    return tuple(int(part) for part in text.split(",")) if text else None


class DistributedExecutor(Executor):
    """What executors of several ranks share: the ranks' layout, the check of the model's shape (before any
    worker starts), and the start-up calls, made on every rank through collective_rpc."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        from pagedserve.executor.uniproc_executor import generation_defaults_of
        from pagedserve.models.loader import eos_token_ids, load_hf_config, resolve_model_dir, validate_parallel_shape

        self.infos = rank_infos(config)
        model_dir = resolve_model_dir(config.model)
        hf_config = load_hf_config(model_dir)
        validate_parallel_shape(hf_config, config.tensor_parallel_size, config.pipeline_parallel_size, self.infos[0].layer_partition)
        self.eos_token_ids = eos_token_ids(model_dir, hf_config)
        self.generation_defaults = generation_defaults_of(config, model_dir)
        self.output_rank = next(info.rank for info in self.infos if info.is_output_rank)
        self.max_concurrent_batches = config.pipeline_parallel_size

    def determine_num_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_blocks"))  # every rank's cache holds the same blocks

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", num_blocks)

    def model_info(self) -> ModelInfo:
        info = self.collective_rpc("info")[self.output_rank]
        return ModelInfo(**info, eos_token_ids=list(self.eos_token_ids), generation_defaults=dict(self.generation_defaults))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit_step(scheduler_output)
        return self.wait_step()

    def wait_for_kv_cache_mapping(self, timeout_s: float | None = None) -> None:
        self.collective_rpc("wait_for_kv_cache_mapping", timeout_s)


class MultiprocExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._pending: deque[float] = deque()  # submit times of the steps in flight
        self._ipc_dir = tempfile.mkdtemp(prefix="pagedserve-workers-")
        self._context = zmq.Context()
        self._results = self._context.socket(zmq.PULL)
        result_address = f"ipc://{self._ipc_dir}/results"
        self._results.bind(result_address)
        self._inputs, self.processes = [], []
        init_method = f"tcp://127.0.0.1:{free_port()}"
        spawn = multiprocessing.get_context("spawn")
        try:
            for info in self.infos:
                address = f"ipc://{self._ipc_dir}/rank{info.rank}"
                socket_ = self._context.socket(zmq.PUSH)
                socket_.bind(address)
                self._inputs.append(socket_)
                process = spawn.Process(target=run_worker, name=f"Worker-{info.rank}", daemon=True,
                                        args=(config, info, init_method, address, result_address, os.getpid()))
                process.start()
                self.processes.append(process)
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

    def collective_rpc(self, method: str, *args) -> list:
        self._broadcast(("call", (method, args)))
        return self._collect(lambda kind: kind == "call", len(self.infos))

    def time_step_messages(self, scheduler_output: SchedulerOutput, reply: ModelRunnerOutput, steps: int) -> list[float]:
        """Seconds of each of `steps` round trips of a step's messages alone: scheduler_output to every rank,
        reply back from the output rank, and no model run (the executor's own per-step cost)."""
        seconds = []
        for _ in range(steps):
            start = time.perf_counter()
            self._broadcast(("probe", (scheduler_output, reply)))
            self._collect(lambda kind: kind == "step", 1)
            seconds.append(time.perf_counter() - start)
        return seconds

    def check_health(self) -> None:
        for rank, process in enumerate(self.processes):
            if not process.is_alive():
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
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
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
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    exit_with_parent(parent_pid)
    logging.basicConfig(level=logging.WARNING if info.rank else logging.INFO,
                        format=f"%(asctime)s %(levelname)s rank {info.rank} %(name)s: %(message)s")
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
        os._exit(1)
    results.send(pickle.dumps(("ready", info.rank, None)))
    runner.serve(inputs, results)
    results.close(linger=1000)
    os._exit(0)  # no interpreter teardown of torch.distributed and the kernels


class WorkerProcess:
    """One rank: its Worker, its host tuning, and the loop that runs what the executor sends."""

    _OWN_CALLS = frozenset({"initialize_cache", "wait_for_kv_cache_mapping"})  # the rest are the Worker's

    def __init__(self, config: EngineConfig, info: RankInfo, init_method: str) -> None:
        import torch

        from pagedserve.distributed.parallel_state import init_distributed
        from pagedserve.executor import cpu_host
        from pagedserve.executor.worker import Worker, resolve_device

        # The cores are shared among the ranks unless the user says otherwise.
        torch.set_num_threads(config.num_threads or max(1, (os.cpu_count() or 1) // info.world_size))
        device = resolve_device(config)
        init_distributed(info, init_method, backend="nccl" if device.type == "cuda" else "gloo")
        self.rank = info
        self.worker = Worker(config)
        self.on_cpu = self.worker.device.type == "cpu"
        if self.on_cpu:
            cpu_host.keep_freed_memory()
        self.prefault = None
        self._cpu_host = cpu_host

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)
        if self.on_cpu and self.worker.config.prefault_kv_cache:
            self.prefault = self._cpu_host.KVCachePrefault(self.worker.kv_caches)

    def wait_for_kv_cache_mapping(self, timeout_s: float | None = None) -> None:
        if self.prefault is not None:
            self.prefault.wait(timeout_s)

    def call(self, method: str, args) -> object:
        target = self if method in self._OWN_CALLS else self.worker
        return getattr(target, method)(*args)

    def serve(self, inputs, results) -> None:
        while True:
            kind, payload = pickle.loads(inputs.recv())
            if kind == "shutdown":
                return
            try:
                if kind in ("step", "probe"):
                    output = self.step(payload) if kind == "step" else payload[1]  # a probe: the messages alone
                    if self.rank.is_output_rank:
                        results.send(pickle.dumps(("step", self.rank.rank, output), protocol=pickle.HIGHEST_PROTOCOL))
                else:
                    results.send(pickle.dumps(("call", self.rank.rank, self.call(*payload))))
            except Exception:
                results.send(pickle.dumps(("error", self.rank.rank, traceback.format_exc())))

    def step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.prefault is not None:
            self.prefault.step_started()
        try:
            return self.worker.execute_model(scheduler_output)
        finally:
            if self.prefault is not None:
                self.prefault.step_ended()
