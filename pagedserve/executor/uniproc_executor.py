"""The executor of one rank in the engine core's own process."""

from __future__ import annotations

import threading
import time
import weakref
from pathlib import Path

from pagedserve.config import EngineConfig
from pagedserve.core.contracts import ModelRunnerOutput, SchedulerOutput
from pagedserve.executor import cpu_host
from pagedserve.executor.abstract import Executor, ModelInfo
from pagedserve.executor.worker import Worker
from pagedserve.models.loader import eos_token_ids, generation_defaults

# The engine counts as idle (the KV prefault may run) once no step has run for this long: steps of
# an engine with requests follow each other within milliseconds.
_IDLE_AFTER_S = 0.05


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config)
        self.on_cpu = self.worker.device.type == "cpu"
        if self.on_cpu:
            cpu_host.keep_freed_memory()
        self.eos_token_ids = eos_token_ids(self.worker.model_dir, self.worker.hf_config)
        self.generation_defaults = _generation_defaults(config, self.worker.model_dir)
        self.kv_prefault: threading.Thread | None = None  # maps the KV cache's pages while the engine is idle
        self._in_step = False
        self._last_step_end = 0.0

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)
        if self.on_cpu and self.config.prefault_kv_cache:
            is_idle = weakref.WeakMethod(self._is_idle)  # the thread must not keep a dropped engine alive
            self.kv_prefault = cpu_host.prefault_in_background(self.worker.kv_caches,
                                                               may_run=lambda: (idle := is_idle()) is None or idle())

    def model_info(self) -> ModelInfo:
        worker = self.worker
        return ModelInfo(model_dir=str(worker.model_dir), max_model_len=worker.max_model_len, vocab_size=worker.hf_config.vocab_size,
                         eos_token_ids=list(self.eos_token_ids), num_blocks=worker.num_blocks,
                         generation_defaults=dict(self.generation_defaults))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._in_step = True
        try:
            return self.worker.execute_model(scheduler_output)
        finally:
            self._in_step = False
            self._last_step_end = time.monotonic()

    def collective_rpc(self, method: str, *args) -> list:
        return [getattr(self.worker, method)(*args)]

    def check_health(self) -> None:
        pass  # the worker lives in this process: if it were gone, so would be the caller

    def wait_for_kv_cache_mapping(self, timeout_s: float | None = None) -> None:
        if self.kv_prefault is not None:
            self.kv_prefault.join(timeout_s)

    def shutdown(self) -> None:
        pass  # the worker's memory goes with the executor

    def _is_idle(self) -> bool:
        return not self._in_step and time.monotonic() - self._last_step_end > _IDLE_AFTER_S


def _generation_defaults(config: EngineConfig, model_dir: Path) -> dict[str, float | int]:
    if config.generation_config == "vllm":
        return {}
    source = model_dir if config.generation_config == "auto" else Path(config.generation_config)
    if config.generation_config != "auto" and not (source / "generation_config.json").is_file():
        raise FileNotFoundError(f"generation_config: no generation_config.json in {source}")
    return generation_defaults(source)
