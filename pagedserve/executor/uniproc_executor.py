"""The executor of one rank in the engine core's own process."""

from __future__ import annotations

from pagedserve.config import EngineConfig
from pagedserve.core.contracts import ModelRunnerOutput, SchedulerOutput
from pagedserve.executor.abstract import Executor, WorkerCall, run_on_worker
from pagedserve.executor.worker import Worker
from pagedserve.model_info import ModelInfo


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config)

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def model_info(self) -> ModelInfo:
        return self.worker.model_info()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def collective_rpc(self, method: WorkerCall, *args) -> list:
        return [run_on_worker(self.worker, method, args)]

    def check_health(self) -> None:
        pass  # the worker lives in this process: if it were gone, so would be the caller

    def wait_for_kv_cache_mapping(self, timeout_s: float | None = None) -> None:
        self.worker.wait_for_kv_cache_mapping(timeout_s)

    def shutdown(self) -> None:
        self.worker.close()  # its memory goes with the executor; its KV connector's threads and ports do not
