"""EngineCore: schedule -> executor.execute_model -> update, once per step."""

from __future__ import annotations

import logging
import time
from collections import deque

from pagedserve.config import EngineConfig
from pagedserve.core.contracts import EngineCoreOutput, SchedulerOutput, SchedulerStats, StepRecord
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.step_time import ExpertRouting, uniform_step_shape
from pagedserve.engine.tokenizer import grammar_compiler
from pagedserve.engine.wire import EngineCoreRequest
from pagedserve.executor import step_timings_cache
from pagedserve.executor.abstract import Executor, WorkerCall
from pagedserve.executor.selector import executor_class as select_executor_class
from pagedserve.kv_transfer.factory import scheduler_connector
from pagedserve.lora_request import LoRARequest
from pagedserve.model_info import ModelInfo
from pagedserve.processes import freeze_start_up_objects
from pagedserve.reasoning_format import REASONING_FORMATS
from pagedserve.request import Request
from pagedserve.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        start = time.monotonic()
        self.config = config
        self.executor = (executor_class or select_executor_class(config))(config)
        try:
            num_blocks = self.executor.determine_num_blocks()
            self.executor.initialize_cache(num_blocks)
            self.model_info: ModelInfo = self.executor.model_info()
            # Expert parallelism over data-parallel cores: every core's model passes join the same collectives, so the
            # cores step together (engine/core_proc.py), their warm-ups included.
            self.steps_with_other_cores = config.data_parallel_place is not None and bool(self.model_info.num_experts)
            warm_up_timings = self._warm_up()
        except BaseException:
            self.executor.shutdown()
            raise
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size, self._prefix_caching(config.enable_prefix_caching))
        # Pipeline parallelism: up to max_concurrent_batches steps in flight; a request's next step waits for its last.
        # Each step in flight, and when it was submitted (perf_counter).
        self.batch_queue: deque[tuple[SchedulerOutput, float]] | None = deque() if self.executor.max_concurrent_batches > 1 else None
        self.last_step: StepRecord | None = None  # the step whose outputs step() returned last
        self.loras: dict[int, LoRARequest] = {}  # the adapters registered, by id
        self._loras_to_drop: set[int] = set()  # removed while requests still run with them
        self._lora_ids: dict[int, LoRARequest] = {}  # every id ever registered, and its adapter
        info = self.model_info
        self.structured_output = StructuredOutputManager(
            grammar_compiler(config.tokenizer or info.model_dir, info.vocab_size, tuple(info.eos_token_ids)),
            REASONING_FORMATS[config.reasoning_parser] if config.reasoning_parser is not None else None)
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_model_len=self.model_info.max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            policy=config.scheduling_policy,
            max_decode_stall=config.decode_stall,
            speculative=config.speculative,
            send_last_tokens=self.batch_queue is not None,
            structured_output=self.structured_output,
            experts=ExpertRouting(info.num_experts, info.experts_per_token) if info.num_experts else None,
            max_loras=config.max_loras if config.enable_lora else None,
            kv_connector=scheduler_connector(config),
        )
        for num_seqs, seq_len, context, seconds in warm_up_timings:  # a first fit of the step-time model
            self.scheduler.observe_step(uniform_step_shape(num_seqs, seq_len, context), seconds)
        freeze_start_up_objects()
        logger.info("engine core ready in %.1f s", time.monotonic() - start)

    def _warm_up(self) -> step_timings_cache.StepTimings:
        """The warm-up steps; their timings (a first fit of the step-time model) from an earlier start when one on this
        machine with these settings stored them, else timed now and stored."""
        start = time.monotonic()
        path = step_timings_cache.timings_file(self.config, self.model_info)
        # Cores that step together run the same warm-up passes, which a stored file read by one and not another would
        # not give.
        timings = None if self.steps_with_other_cores else step_timings_cache.load(path)
        if timings is not None:
            self.executor.collective_rpc("warm_up", False)
            logger.info("warm-up steps ran in %.1f s (step timings of an earlier start: %s)", time.monotonic() - start, path)
            return timings
        timings = self.executor.collective_rpc("warm_up", True)[0]
        step_timings_cache.store(path, timings)
        logger.info("warm-up steps ran and were timed in %.1f s", time.monotonic() - start)
        return timings

    def add_request(self, request: EngineCoreRequest) -> None:
        lora = request.lora_request
        if lora is not None and self.loras.get(lora.lora_int_id) != lora:  # not registered yet (or another adapter's id)
            self.add_lora(lora.lora_name, lora.lora_int_id, lora.lora_path)
        self.scheduler.add_request(
            Request(
                request.request_id,
                request.prompt_token_ids,
                request.sampling_params,
                arrival_time=request.arrival_time,
                priority=request.priority,
                group_id=request.group_id,
                lora_request=request.lora_request,
            )
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids)

    def wake_sockets(self) -> list:
        """Sockets whose messages give an idle core work (its KV connector's), beside its input."""
        return self.scheduler.kv_connector.wake_sockets() if self.scheduler.kv_connector is not None else []

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.scheduler.has_news_for_runner() or bool(self.batch_queue)

    def step(self) -> list[EngineCoreOutput]:
        self.last_step = None
        if not self.has_work():
            return []
        outputs = self._step_with_batch_queue() if self.batch_queue is not None else self._step()
        if self._loras_to_drop:
            self._drop_unused_loras()
        return outputs

    def step_with_other_cores(self) -> list[EngineCoreOutput]:
        """A step all data-parallel cores take together (steps_with_other_cores): this core's, or, with nothing to run
        here, an empty one, in which the runner joins the others' passes."""
        self.last_step = None
        outputs = self._step()
        if self._loras_to_drop:
            self._drop_unused_loras()
        return outputs

    def _step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        start = time.perf_counter()
        runner_output = self.executor.execute_model(scheduler_output)
        seconds = time.perf_counter() - start - runner_output.waited_for_other_cores_s
        if not scheduler_output.is_empty:  # an empty step's time is another core's, or nothing
            self.scheduler.observe_step(scheduler_output.shape, seconds)
            self.last_step = StepRecord.of(scheduler_output, seconds, time.time())
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def _step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """Submit a step when one can be scheduled and the pipeline has room; take back the oldest step's output
        when the pipeline is full or nothing new could be scheduled."""
        queue = self.batch_queue
        submitted = False
        if len(queue) < self.executor.max_concurrent_batches:
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.needs_runner:
                self.executor.submit_step(scheduler_output)
                queue.append((scheduler_output, time.perf_counter()))
                submitted = True
        if queue and (len(queue) == self.executor.max_concurrent_batches or not submitted):
            scheduler_output, submitted_at = queue.popleft()
            runner_output = self.executor.wait_step()
            # From submission to output: a step in a pipeline overlaps the ones beside it.
            self.last_step = StepRecord.of(scheduler_output, time.perf_counter() - submitted_at, time.time())
            return self.scheduler.update_from_output(scheduler_output, runner_output)
        return []

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def _prefix_caching(self, configured: bool) -> bool:
        """Whether the engine reuses cached prefixes: as configured, but for a pooler that reads every prompt token's
        hidden state (a cached prefix has none)."""
        pooler = self.model_info.pooler
        if not configured or pooler is None or not pooler.reads_every_token:
            return configured
        logger.info("pooling %s: every prompt is computed whole (no prefix caching)", pooler.pooling_type)
        return False

    def shutdown(self) -> None:
        self.structured_output.shutdown()
        self.executor.shutdown()
        if self.scheduler.kv_connector is not None:
            self.scheduler.kv_connector.close()

    # ---- utility calls (by name, from either client) -------------------------------------------

    def call_utility(self, method: str, *args):
        if method not in _UTILITIES:
            raise ValueError(f"unknown engine utility {method!r}; known: {', '.join(sorted(_UTILITIES))}")
        return getattr(self, method)(*args)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def wait_for_kv_cache_mapping(self, timeout_s: float | None = None) -> None:
        self.executor.wait_for_kv_cache_mapping(timeout_s)

    def add_lora(self, lora_name: str, lora_int_id: int, lora_path: str) -> bool:
        """Register an adapter, read and checked on every rank now (ValueError naming the problem); whether it was new.
        The workers may let its weights go when others need the room, and read them again when a request needs them."""
        lora = LoRARequest(lora_name, lora_int_id, lora_path)
        if not self.config.enable_lora:
            raise ValueError("LoRA adapters are not enabled; start the engine with enable_lora")
        named = self._lora_ids.get(lora_int_id, lora)
        if named != lora:  # removed or not, an id keeps its weights: the prefix cache keys blocks by it
            raise ValueError(f"lora_int_id {lora_int_id} names LoRA adapter {named.lora_name!r} at {named.lora_path} in this "
                             "engine; give another adapter another id")
        self._loras_to_drop.discard(lora_int_id)  # registered again before its last request ended
        if lora_int_id in self.loras:
            return False
        problems = [problem for problem in self.executor.collective_rpc("add_lora", lora) if problem]
        if problems:
            self.executor.collective_rpc("remove_lora", lora_int_id)  # from the ranks that took it
            raise ValueError(problems[0])
        self.loras[lora_int_id] = self._lora_ids[lora_int_id] = lora
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter: no new request may name it; the ranks let its weights go once the requests that run with
        it have ended (their directory may be gone by then)."""
        if self.loras.pop(lora_int_id, None) is None:
            return False
        self._loras_to_drop.add(lora_int_id)
        self._drop_unused_loras()
        return True

    def _drop_unused_loras(self) -> None:
        in_use = {request.lora_id for request in self.scheduler.requests.values()}
        for lora_int_id in self._loras_to_drop - in_use:
            self.executor.collective_rpc("remove_lora", lora_int_id)
        self._loras_to_drop &= in_use

    def list_loras(self) -> list[int]:
        return sorted(self.loras)

    def collective_rpc(self, method: WorkerCall, *args) -> list:
        """A worker method (or a function of the worker) run on every rank; their results in rank order. The route
        by which tools such as the benchmarks measure a worker, so that the engine itself carries no such code."""
        return self.executor.collective_rpc(method, *args)


_UTILITIES = frozenset({"reset_prefix_cache", "wait_for_kv_cache_mapping", "get_stats", "collective_rpc", "add_lora", "remove_lora",
                        "list_loras"})

