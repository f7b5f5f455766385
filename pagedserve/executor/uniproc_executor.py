"""The executor of one rank in the engine core's own process."""

from __future__ import annotations

from pathlib import Path

from pagedserve.config import EngineConfig
from pagedserve.core.contracts import ModelRunnerOutput, SchedulerOutput
from pagedserve.executor import cpu_host
from pagedserve.executor.abstract import Executor, ModelInfo
from pagedserve.executor.worker import Worker
from pagedserve.models.loader import eos_token_ids, generation_defaults


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config)
        self.on_cpu = self.worker.device.type == "cpu"
        if self.on_cpu:
            cpu_host.keep_freed_memory()
        self.eos_token_ids = eos_token_ids(self.worker.model_dir, self.worker.hf_config)
        self.generation_defaults = generation_defaults_of(config, self.worker.model_dir)
        self.kv_prefault: cpu_host.KVCachePrefault | None = None  # maps the KV cache's pages while the engine is idle

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)
        if self.on_cpu and self.config.prefault_kv_cache:
            self.kv_prefault = cpu_host.KVCachePrefault(self.worker.kv_caches + self.worker.draft_kv_caches)

    def model_info(self) -> ModelInfo:
        worker = self.worker
        return ModelInfo(model_dir=str(worker.model_dir), max_model_len=worker.max_model_len, vocab_size=worker.hf_config.vocab_size,
                         eos_token_ids=list(self.eos_token_ids), num_blocks=worker.num_blocks,
                         generation_defaults=dict(self.generation_defaults))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.kv_prefault is None:
            return self.worker.execute_model(scheduler_output)
        self.kv_prefault.step_started()
        try:
            return self.worker.execute_model(scheduler_output)
        finally:
            self.kv_prefault.step_ended()

    def collective_rpc(self, method: str, *args) -> list:
        return [getattr(self.worker, method)(*args)]

    def check_health(self) -> None:
        pass  # the worker lives in this process: if it were gone, so would be the caller

    def wait_for_kv_cache_mapping(self, timeout_s: float | None = None) -> None:
        if self.kv_prefault is not None:
            self.kv_prefault.wait(timeout_s)

    def shutdown(self) -> None:
        pass  # the worker's memory goes with the executor


def generation_defaults_of(config: EngineConfig, model_dir: Path) -> dict[str, float | int]:
    if config.generation_config == "vllm":
        return {}
    source = model_dir if config.generation_config == "auto" else Path(config.generation_config)
    if config.generation_config != "auto" and not (source / "generation_config.json").is_file():
        raise FileNotFoundError(f"generation_config: no generation_config.json in {source}")
    return generation_defaults(source)
