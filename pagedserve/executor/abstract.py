"""The executor interface: the engine core's only handle on workers, models and devices.

An executor owns one or more workers (one per rank). Each step the engine core hands it the
scheduler's output and gets back one ModelRunnerOutput; it never sees a tensor. This module imports
no torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from pagedserve.config import EngineConfig
from pagedserve.core.contracts import ModelRunnerOutput, SchedulerOutput
from pagedserve.model_info import ModelInfo

# A call made on every rank: a Worker method by name, or a module-level function called with the worker first
# (picklable by reference, so it travels to worker processes).
WorkerCall = str | Callable


def run_on_worker(worker, method: WorkerCall, args: tuple):
    return method(worker, *args) if callable(method) else getattr(worker, method)(*args)


class Executor(ABC):
    """Start-up runs determine_num_blocks(), then initialize_cache(), then model_info(); then
    execute_model() once per step until shutdown()."""

    @staticmethod
    def model_dir(config: EngineConfig) -> str:
        """Where the model's HF-format files are (a GGUF converted first), found without loading anything."""
        from pagedserve.models.location import resolve_model_dir

        return str(resolve_model_dir(config.model))

    @staticmethod
    def transformers_checkpoint(model_dir: str) -> str:
        """A directory transformers loads whole with model_dir's weights: model_dir, or a converted GGUF model's export
        (its directory keeps most weights as GGUF blocks alone), written once."""
        from pathlib import Path

        from pagedserve.models.hf_export import transformers_checkpoint

        return str(transformers_checkpoint(Path(model_dir)))

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    # Steps that may be in flight at once: more than one under pipeline parallelism (submit_step / wait_step).
    max_concurrent_batches = 1

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
    def collective_rpc(self, method: WorkerCall, *args) -> list:
        """Call a worker method (or a function of the worker) on every rank; their results in rank order."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise if a worker is gone."""

    @abstractmethod
    def wait_for_kv_cache_mapping(self, timeout_s: float | None = None) -> None:
        """Return once the KV cache's memory is mapped in (CPU: and gathered into 2 MB pages; see
        cpu_host.prefault_in_background)."""

    @abstractmethod
    def shutdown(self) -> None: ...
