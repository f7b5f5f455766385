"""The executor interface: the engine core's only handle on workers, models and devices.

An executor owns one or more workers (one per rank). Each step the engine core hands it the
scheduler's output and gets back one ModelRunnerOutput; it never sees a tensor. This module imports
no torch: the front end reads ModelInfo from it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from pagedserve.config import EngineConfig
from pagedserve.core.contracts import ModelRunnerOutput, SchedulerOutput


@dataclass
class ModelInfo:
    """What the engine core and front end need to know of the loaded model (the ready handshake)."""

    model_dir: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_blocks: int
    # Default sampling parameters (SamplingParams field names) from the generation config; empty when none.
    generation_defaults: dict[str, float | int]


class Executor(ABC):
    """Start-up runs determine_num_blocks(), then initialize_cache(), then model_info(); then
    execute_model() once per step until shutdown()."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    # Steps that may be in flight at once: more than one under pipeline parallelism (submit_step / wait_step).
    max_concurrent_batches = 1

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        backend = config.executor_backend
        if backend == "ray":
            from pagedserve.executor.ray_executor import RayExecutor

            return RayExecutor
        if backend == "mp":
            from pagedserve.executor.multiproc_executor import MultiprocExecutor

            return MultiprocExecutor
        from pagedserve.executor.uniproc_executor import UniprocExecutor

        return UniprocExecutor

    def submit_step(self, scheduler_output: SchedulerOutput) -> None:
        """Start a step without waiting for it (executors with max_concurrent_batches > 1)."""
        raise NotImplementedError

    def wait_step(self) -> ModelRunnerOutput:
        """The output of the oldest step submitted."""
        raise NotImplementedError

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """How many KV cache blocks fit every rank's memory budget."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate num_blocks KV blocks on every rank and make the workers ready to run steps."""

    @abstractmethod
    def model_info(self) -> ModelInfo: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    @abstractmethod
    def collective_rpc(self, method: str, *args) -> list:
        """Call a worker method on every rank; their results in rank order."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise if a worker is gone."""

    @abstractmethod
    def wait_for_kv_cache_mapping(self, timeout_s: float | None = None) -> None:
        """Return once the KV cache's memory is mapped in (CPU: see cpu_host.prefault_in_background)."""

    @abstractmethod
    def shutdown(self) -> None: ...
