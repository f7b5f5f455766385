"""EngineCore: schedule -> run the model -> update, once per step."""

from __future__ import annotations

import logging
import time
import weakref

from pagedserve.config import EngineConfig
from pagedserve.core.interface import EngineCoreOutput, EngineCoreRequest
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler
from pagedserve.executor.kv_prefault import prefault_in_background
from pagedserve.executor.worker import Worker
from pagedserve.request import Request

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        start = time.monotonic()
        self.config = config
        self.worker = Worker(config)
        self.kv_cache_manager = KVCacheManager(self.worker.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_model_len=self.worker.max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            policy=config.scheduling_policy,
        )
        self.kv_prefault = None  # the thread mapping the KV cache's pages, while it runs
        if config.prefault_kv_cache and self.worker.device.type == "cpu":
            is_idle = weakref.WeakMethod(self.is_idle)  # the thread must not keep a dropped engine alive
            self.kv_prefault = prefault_in_background(self.worker.kv_caches, may_run=lambda: (idle := is_idle()) is None or idle())
        logger.info("engine core ready in %.1f s", time.monotonic() - start)

    @property
    def max_model_len(self) -> int:
        return self.worker.max_model_len

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(
            Request(
                request.request_id,
                request.prompt_token_ids,
                request.sampling_params,
                arrival_time=request.arrival_time,
                priority=request.priority,
                group_id=request.group_id,
            )
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids)

    def is_idle(self) -> bool:
        """No request waiting or running (finished ones may still await collection)."""
        return not self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.scheduler.finished_req_ids)

    def step(self) -> list[EngineCoreOutput]:
        if not self.has_work():
            return []
        scheduler_output = self.scheduler.schedule()
        runner_output = self.worker.model_runner.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)
