"""What the executors of several ranks share (mp and ray): the ranks' layout, the check of the model's shape before
any worker starts, the start-up calls made on every rank, and the process a rank runs in (WorkerProcess)."""

from __future__ import annotations

import logging

from pagedserve.config import EngineConfig
from pagedserve.core.contracts import ModelRunnerOutput, SchedulerOutput
from pagedserve.distributed.parallel_state import RankInfo
from pagedserve.executor.abstract import Executor, WorkerCall, run_on_worker
from pagedserve.model_info import ModelInfo
from pagedserve.processes import freeze_start_up_objects

logger = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    pass


def rank_infos(config: EngineConfig) -> list[RankInfo]:
    partition = tuple(int(part) for part in config.pp_layer_partition.split(",")) if config.pp_layer_partition else None
    return [RankInfo(config.tensor_parallel_size, config.pipeline_parallel_size, rank, partition, config.enable_expert_parallel)
            for rank in range(config.world_size)]


def log_expert_parallelism(hf_config, tensor_parallel_size: int) -> None:
    from pagedserve.models.moe import moe_shape

    shape = moe_shape(hf_config)
    if shape is None:
        logger.warning("enable_expert_parallel changes nothing: the model has no experts")
    else:
        logger.info("expert parallelism: %d experts on each of the %d tensor-parallel ranks", shape.num_experts // tensor_parallel_size,
                    tensor_parallel_size)


class DistributedExecutor(Executor):
    """Start-up runs on every rank through collective_rpc; the output rank's answers are the engine's."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        from pagedserve.models.hf_config import load_hf_config
        from pagedserve.models.loader import validate_parallel_shape
        from pagedserve.models.location import resolve_model_dir

        self.infos = rank_infos(config)
        hf_config = load_hf_config(resolve_model_dir(config.model), config.hf_overrides)
        validate_parallel_shape(hf_config, config.tensor_parallel_size, config.pipeline_parallel_size, self.infos[0].layer_partition,
                                config.enable_expert_parallel)
        if config.enable_expert_parallel and config.data_parallel_place is None:  # over data-parallel cores: the workers say
            log_expert_parallelism(hf_config, config.tensor_parallel_size)
        self.output_rank = next(info.rank for info in self.infos if info.is_output_rank)
        self.max_concurrent_batches = config.pipeline_parallel_size

    def determine_num_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_blocks"))  # every rank's cache holds the same blocks

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", num_blocks)

    def model_info(self) -> ModelInfo:
        return self.collective_rpc("model_info")[self.output_rank]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit_step(scheduler_output)
        return self.wait_step()

    def wait_for_kv_cache_mapping(self, timeout_s: float | None = None) -> None:
        self.collective_rpc("wait_for_kv_cache_mapping", timeout_s)


class WorkerProcess:
    """One rank, in a process of its own: it joins the ranks' process group, then holds its Worker."""

    def __init__(self, config: EngineConfig, info: RankInfo, init_method: str) -> None:
        from pagedserve.distributed.parallel_state import init_distributed
        from pagedserve.executor.worker import Worker, resolve_device

        init_distributed(info, init_method, backend="nccl" if resolve_device(config).type == "cuda" else "gloo")
        self.rank = info
        self.worker = Worker(config)
        freeze_start_up_objects()

    def call(self, method: WorkerCall, args: tuple) -> object:
        return run_on_worker(self.worker, method, args)

    def step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)
