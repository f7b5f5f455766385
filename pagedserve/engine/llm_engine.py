"""LLMEngine: the synchronous front end (tokenize, run the core in-process, detokenize)."""

from __future__ import annotations

import logging

from pagedserve.config import EngineConfig
from pagedserve.engine.core import EngineCore
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.processor import Processor, PromptType
from pagedserve.engine.tokenizer import load_tokenizer
from pagedserve.models.loader import eos_token_ids
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.engine_core = EngineCore(config)
        worker = self.engine_core.worker
        self.tokenizer = load_tokenizer(config.tokenizer or worker.model_dir)
        self.processor = Processor(
            self.tokenizer, worker.max_model_len, eos_token_ids(worker.model_dir, worker.hf_config), worker.hf_config.vocab_size
        )
        self.output_processor = OutputProcessor(self.tokenizer)

    @property
    def max_model_len(self) -> int:
        return self.engine_core.max_model_len

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0) -> None:
        processed = self.processor.tokenize_prompt(prompt)
        params, engine_requests = self.processor.process(request_id, processed, params, priority)
        self.output_processor.add_request(request_id, processed.prompt, processed.prompt_token_ids, params)
        for engine_request in engine_requests:
            self.engine_core.add_request(engine_request)

    def abort_request(self, request_ids: str | list[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            engine_ids = self.output_processor.engine_ids(request_id)
            self.output_processor.abort_request(request_id)
            self.engine_core.abort_requests(engine_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        processed = self.output_processor.process_outputs(self.engine_core.step())
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def get_stats(self):
        return self.engine_core.scheduler.get_stats()
