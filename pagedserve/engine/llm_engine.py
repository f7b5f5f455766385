"""LLMEngine: the synchronous front end over an in-process engine core."""

from __future__ import annotations

from pagedserve.config import EngineConfig
from pagedserve.core.contracts import SchedulerStats
from pagedserve.engine.core_client import EngineCoreClient, InprocClient
from pagedserve.engine.frontend import FrontEnd, FrontEndAccess
from pagedserve.engine.processor import PromptType
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams


class LLMEngine(FrontEndAccess):
    def __init__(self, config: EngineConfig) -> None:
        if config.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size ({config.data_parallel_size}) > 1 runs engine cores behind the server "
                             "(pagedserve serve); the offline LLM runs one")
        self.config = config
        self.client: EngineCoreClient = InprocClient(config)
        self.front_end = FrontEnd(config, self.client.model_info)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0) -> None:
        self.client.add_requests(self.front_end.add_request(request_id, prompt, params, priority))

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
