"""LLMEngine: the synchronous front end over an in-process engine core."""

from __future__ import annotations

from pagedserve.config import EngineConfig
from pagedserve.core.contracts import SchedulerStats
from pagedserve.engine.core_client import EngineCoreClient, InprocClient
from pagedserve.engine.frontend import FrontEnd, FrontEndAccess
from pagedserve.engine.processor import PromptType
from pagedserve.lora_request import LoRARequest
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams


class LLMEngine(FrontEndAccess):
    def __init__(self, config: EngineConfig) -> None:
        if config.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size ({config.data_parallel_size}) > 1 runs engine cores behind the server "
                             "(pagedserve serve); the offline LLM runs one")
        self.config = config
        self.client: EngineCoreClient = InprocClient(config)
        try:
            self.front_end = FrontEnd(config, self.client.model_info)
        except BaseException:
            self.client.shutdown()
            raise

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> None:
        engine_requests = self.front_end.add_request(request_id, prompt, params, priority, lora_request)
        if lora_request is not None:
            try:
                self.add_lora(lora_request)  # read and checked now, so that a bad adapter fails here, by name
            except ValueError:
                self.front_end.abort_request(request_id)
                raise
        self.client.add_requests(engine_requests)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter with the engine (read and checked on every rank); whether it was new."""
        return self.client.call_utility("add_lora", lora_request.lora_name, lora_request.lora_int_id, lora_request.lora_path)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.client.call_utility("remove_lora", lora_int_id)

    def list_loras(self) -> list[int]:
        return self.client.call_utility("list_loras")

    def abort_request(self, request_ids: str | list[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.client.abort_requests(self.front_end.abort_request(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.front_end.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        processed = self.front_end.process_outputs(self.client.get_output().outputs)
        if processed.reqs_to_abort:
            self.client.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def get_stats(self) -> SchedulerStats:
        return self.client.call_utility("get_stats")

    def call_utility(self, method: str, *args):
        """An engine-core utility by name (reset_prefix_cache, wait_for_kv_cache_mapping, get_stats, collective_rpc)."""
        return self.client.call_utility(method, *args)

    def shutdown(self) -> None:
        self.client.shutdown()
