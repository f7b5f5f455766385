"""AsyncLLM: the online front end. Tokenizes, streams each request's outputs, aborts on disconnect."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from pagedserve.config import EngineConfig
from pagedserve.engine.core_client import AsyncMPClient, EngineCoreClient, EngineDeadError
from pagedserve.engine.dp_client import DPAsyncMPClient
from pagedserve.engine.engine_view import EngineView
from pagedserve.engine.frontend import FrontEnd, FrontEndAccess
from pagedserve.engine.metrics import EngineMetrics
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.processor import PromptType
from pagedserve.engine.tokenizer import load_tokenizer, preload_tokenizer_library
from pagedserve.lora_request import LoRARequest
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    pass


class RequestEndedError(RuntimeError):
    """The server ended the request before it finished (it is shutting down)."""


class AsyncLLM(FrontEndAccess):
    def __init__(self, config: EngineConfig, served_model_name: str | None = None, max_waiting_requests: int | None = None,
                 on_engine_dead: Callable[[], None] | None = None, while_starting: Callable[[], None] | None = None) -> None:
        """while_starting: more front-end work (imports, say) to do while the engine process starts."""
        self.config = config

        def front_end_start_up() -> None:
            # The front end's own slow imports overlap the engine's start-up (separate processes, separate cores).
            preload_tokenizer_library()
            if while_starting is not None:
                while_starting()

        tokenizer = output_processor = None

        def on_model_located(model_dir: str) -> None:  # made while the engine loads the model
            nonlocal tokenizer, output_processor
            tokenizer = load_tokenizer(config.tokenizer or model_dir)
            output_processor = OutputProcessor(tokenizer)

        client_class = DPAsyncMPClient if config.data_parallel_size > 1 else AsyncMPClient
        self.client: EngineCoreClient = client_class(config, while_starting=front_end_start_up, on_model_located=on_model_located)
        try:
            self.front_end = FrontEnd(config, self.client.model_info, tokenizer, output_processor)
        except BaseException:
            self.client.shutdown()
            raise
        self.metrics = EngineMetrics(served_model_name or config.model, config.data_parallel_size)
        self.engine_view = EngineView(self.metrics, self.front_end.prompt_of)
        self.max_waiting_requests = max_waiting_requests
        self._loras: set[int] = set()  # the LoRA adapters registered with the engine cores, by id
        self.on_engine_dead = on_engine_dead
        self._queues: dict[str, asyncio.Queue] = {}
        # Each engine core's waiting queue as of its last step; plus what was sent since any's last step.
        self._engine_waiting = [0] * config.data_parallel_size
        self._sent_since_stats = 0
        self._output_task: asyncio.Task | None = None
        self.dead_error: Exception | None = None

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and self.client.is_alive()

    def start(self) -> None:
        """Start handling the engine's outputs (and noticing its death) in the running event loop."""
        if self._output_task is None or self._output_task.done():
            self._output_task = asyncio.get_running_loop().create_task(self._output_handler(), name="output-handler")

    async def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs as they come; leaving the loop early aborts the request. ValueError on an engine
        whose model gives no text (pagedserve/tasks.py)."""
        self.front_end.check_task("generate")
        queue = await self.add_request(prompt, params, request_id, priority)
        async for output in self.iterate(request_id, queue):
            yield output

    async def iterate(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """The outputs of a request added with add_request; leaving early aborts it."""
        finished = False
        try:
            while True:
                item = queue.get_nowait() if not queue.empty() else await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                await self.abort(request_id)

    async def add_request(self, prompt: PromptType, params: SamplingParams, request_id: str, priority: int = 0,
                          lora_request: LoRARequest | None = None) -> asyncio.Queue:
        """lora_request: an adapter registered with add_lora (None: the base model)."""
        self._check_admission(params.n)
        # Tokenizing (a long prompt: seconds) runs off the event loop, which keeps serving other streams.
        prepared = await asyncio.to_thread(self.front_end.prepare, request_id, prompt, params, priority, lora_request)
        self._check_admission(params.n)  # again: the engine may have died or filled up meanwhile
        engine_requests = self.front_end.track(prepared)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._sent_since_stats += len(engine_requests)
        for engine_request in engine_requests:
            self.metrics.request_added(engine_request.request_id, engine_request.arrival_time, len(engine_request.prompt_token_ids))
        self.start()
        try:
            await self.client.add_requests_async(engine_requests)
        except BaseException:  # the engine died or we were cancelled: leave no half-registered request
            self._forget(request_id, self.front_end.abort_request(request_id))
            raise
        return queue

    def _check_admission(self, num_samples: int) -> None:
        if self.dead_error is not None:
            raise EngineDeadError("the engine core is dead") from self.dead_error
        num_waiting = sum(self._engine_waiting) + self._sent_since_stats
        if self.max_waiting_requests is not None and num_waiting + num_samples > self.max_waiting_requests:
            raise QueueFullError(f"the server is at capacity: {num_waiting} samples are waiting, and this request adds "
                                 f"{num_samples} (limit {self.max_waiting_requests})")

    def num_in_flight(self) -> int:
        """Requests whose outputs are still awaited."""
        return len(self._queues)

    async def end_all(self, message: str) -> None:
        """End every in-flight request now: its consumer gets RequestEndedError(message), the engine an abort."""
        for request_id, queue in list(self._queues.items()):
            queue.put_nowait(RequestEndedError(message))
            engine_ids = self.front_end.abort_request(request_id)
            self._forget(request_id, engine_ids)
            await self.client.abort_requests_async(engine_ids)

    async def abort(self, request_id: str) -> None:
        engine_ids = self.front_end.abort_request(request_id)
        self._forget(request_id, engine_ids)
        await self.client.abort_requests_async(engine_ids)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter with every engine core, read and checked on every rank now (ValueError naming the
        problem); whether it was new."""
        results = await self.client.call_utility_on_each_async(
            "add_lora", lora_request.lora_name, lora_request.lora_int_id, lora_request.lora_path)
        self._loras.add(lora_request.lora_int_id)
        self.metrics.lora_adapters.set(len(self._loras))
        return any(results)

    async def remove_lora(self, lora_int_id: int) -> bool:
        removed = any(await self.client.call_utility_on_each_async("remove_lora", lora_int_id))
        self._loras.discard(lora_int_id)
        self.metrics.lora_adapters.set(len(self._loras))
        return removed

    async def reset_prefix_cache(self) -> bool:
        return await self.client.call_utility_async("reset_prefix_cache")

    async def refresh_expert_metrics(self) -> None:
        """The tokens routed to each expert of each mixture layer, read from every engine core's ranks (a call each
        core answers between two steps) into the metrics. A dense model has none."""
        if not self.model_info.num_experts:
            return
        per_core = await self.client.call_utility_on_each_async("collective_rpc", "expert_token_counts")
        for engine, ranks in enumerate(per_core):
            layers: dict[int, list[int]] = {}
            for rank_layers in ranks:  # a stage's tensor-parallel ranks route alike: the first one's counts are the layer's
                for layer, counts in rank_layers.items():
                    layers.setdefault(int(layer), counts)
            self.metrics.record_expert_tokens(engine, layers)

    def _forget(self, request_id: str, engine_ids: list[str]) -> None:
        self._queues.pop(request_id, None)
        for engine_id in engine_ids:
            self.metrics.request_aborted(engine_id)

    async def _output_handler(self) -> None:
        try:
            while True:
                core_outputs = await self.client.get_output_async()
                engine = core_outputs.engine_index
                self.metrics.record_outputs(core_outputs.outputs, core_outputs.scheduler_stats, time.monotonic(), engine)
                if core_outputs.scheduler_stats is not None:
                    self._engine_waiting[engine], self._sent_since_stats = core_outputs.scheduler_stats.num_waiting, 0
                if core_outputs.step is not None:
                    self.engine_view.record_step(engine, core_outputs.step)
                processed = self.front_end.process_outputs(core_outputs.outputs)
                for output in processed.request_outputs:
                    queue = self._queues.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
                    if output.finished:
                        self._queues.pop(output.request_id, None)
                if processed.reqs_to_abort:
                    for engine_id in processed.reqs_to_abort:
                        self.metrics.request_stopped_by_string(engine_id, time.monotonic())
                    await self.client.abort_requests_async(processed.reqs_to_abort)
        except EngineDeadError as exc:
            self.mark_dead(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave clients hanging
            logger.exception("output handler failed")
            self.mark_dead(exc)

    def mark_dead(self, exc: Exception) -> None:
        """The engine core is gone: fail every in-flight request and tell the server."""
        if self.dead_error is not None:
            return
        logger.error("engine core is dead: %s", exc)
        self.dead_error = exc
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(str(exc)))
        self._queues.clear()
        if self.on_engine_dead is not None:
            self.on_engine_dead()

    def shutdown(self) -> None:
        if self._output_task is not None:
            self._output_task.cancel()
        self.client.shutdown()
