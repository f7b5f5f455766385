"""The front end LLMEngine and AsyncLLM share: the tokenizer, input processing (prompts and
parameters -> validated engine requests, one per sample) and output processing (engine-core
outputs -> RequestOutputs: text, stop strings, logprobs, samples gathered)."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from pagedserve.config import EngineConfig, KVTransferConfig
from pagedserve.core.contracts import EngineCoreOutput
from pagedserve.engine.output_processor import OutputProcessor, ProcessedOutputs
from pagedserve.engine.processor import ProcessedPrompt, Processor, PromptType
from pagedserve.engine.tokenizer import grammar_compiler, load_tokenizer
from pagedserve.engine.wire import EngineCoreRequest
from pagedserve.lora_request import LoRARequest
from pagedserve.matryoshka import check_dimensions, shortened
from pagedserve.model_info import ModelInfo
from pagedserve.outputs import ClassificationOutput, ClassificationRequestOutput, EmbeddingRequestOutput
from pagedserve.reasoning_format import REASONING_FORMATS
from pagedserve.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.tasks import check_task, supported_tasks


@dataclass
class PreparedRequest:
    """A request tokenized and validated, not yet tracked (prepare() may run in a worker thread)."""

    request_id: str
    prompt: ProcessedPrompt
    params: SamplingParams  # completed: max_tokens known, EOS ids filled in
    engine_requests: list[EngineCoreRequest]


class FrontEnd:
    """One per LLMEngine or AsyncLLM, which differ only in how they reach the engine core and deliver outputs."""

    def __init__(self, config: EngineConfig, model_info: ModelInfo, tokenizer=None,
                 output_processor: OutputProcessor | None = None) -> None:
        """tokenizer, output_processor: the model's tokenizer and an output processor over it, when already made."""
        self.model_info = model_info
        tokenizer_dir = config.tokenizer or model_info.model_dir
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(tokenizer_dir)
        # A request's structure is compiled here first, within a time limit, so that a bad one is refused before it
        # reaches the engine core (which compiles it again, from its own cache or this one's).
        self.grammars = grammar_compiler(tokenizer_dir, model_info.vocab_size, tuple(model_info.eos_token_ids))
        self.structure_time_limit_s = config.structured_outputs_compile_timeout
        if config.reasoning_parser is not None:  # the engine core's structures begin after </think>: one token
            REASONING_FORMATS[config.reasoning_parser].marker_ids(self.tokenizer)
        self.enable_lora = config.enable_lora
        self.kv_transfer = config.kv_transfer
        self.pooling = config.runner == "pooling"
        self.tasks = supported_tasks(config.runner, model_info.classifier)
        # Whether embeddings come normalized: a shortened one is normalized again.
        self.normalized_embeddings = model_info.pooler is not None and model_info.pooler.normalize
        self.processor = Processor(self.tokenizer, model_info, self.pooling)
        self.output_processor = output_processor if output_processor is not None else OutputProcessor(self.tokenizer)

    @property
    def max_model_len(self) -> int:
        return self.model_info.max_model_len

    def cap_unrequested_tokens(self, server_default: int | None) -> None:
        """A request that gives no max_tokens generates at most the model's max_new_tokens (its generation config), else
        server_default (None: up to the context); never more than the room its prompt leaves."""
        self.processor.default_max_tokens = self.model_info.generation_defaults.get("max_tokens", server_default)

    def check_task(self, task: str) -> None:
        """Refuse (ValueError) a request for what the engine's model does not give (pagedserve/tasks.py)."""
        check_task(task, self.tasks)

    def pair_prompt(self, first: str, second: str, truncating: bool = False) -> PromptType:
        """A text pair as a cross-encoder reads it: one prompt of both (check_task("score") first)."""
        return {"prompt_token_ids": self.processor.tokenize_pair(first, second, truncating)}

    def classified(self, output: EmbeddingRequestOutput, use_activation: bool = True) -> ClassificationRequestOutput:
        """A classification model's pooled output (its logits) as its labels' probabilities, or with use_activation
        false its logits."""
        logits = np.frombuffer(output.outputs.data, dtype=np.float32)
        probs = self.model_info.classifier.probabilities(logits, use_activation).tolist()
        return ClassificationRequestOutput(output.request_id, output.prompt_token_ids, ClassificationOutput(probs),
                                           num_cached_tokens=output.num_cached_tokens)

    def pair_score(self, output: EmbeddingRequestOutput) -> float:
        """A cross-encoder's score of the pair prompt whose pooled output (its logit) this is."""
        return self.model_info.classifier.pair_score(np.frombuffer(output.outputs.data, dtype=np.float32))

    def check_dimensions(self, dimensions: int | None) -> None:
        """Refuse (ValueError naming dimensions) a size the model's embeddings cannot be shortened to."""
        if dimensions is not None:
            check_dimensions(dimensions, self.model_info.matryoshka_dimensions)

    def shortened(self, output: EmbeddingRequestOutput, dimensions: int | None) -> EmbeddingRequestOutput:
        """An embedding as a request asked for it (check_dimensions first): its first `dimensions` values, or whole."""
        if dimensions is None:
            return output
        return msgspec.structs.replace(output, outputs=shortened(output.outputs, dimensions, self.normalized_embeddings))

    @staticmethod
    def embedding_params(truncate_prompt_tokens: int | None = None) -> SamplingParams:
        """What an embedding request carries to the engine core: its prompt's handling (nothing is sampled)."""
        return SamplingParams(max_tokens=1, temperature=0.0, truncate_prompt_tokens=truncate_prompt_tokens,
                              output_kind=RequestOutputKind.FINAL_ONLY)

    def default_sampling_params(self, **base) -> SamplingParams:
        """SamplingParams of the base values, overridden by the model's generation defaults (generation_config)."""
        return SamplingParams(**(base | self.model_info.generation_defaults))

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> list[EngineCoreRequest]:
        """Validate and track a request; returns the engine requests to send (one per sample).
        Raises ValueError/TypeError naming the bad field, having tracked nothing."""
        return self.track(self.prepare(request_id, prompt, params, priority, lora_request))

    def prepare(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
                lora_request: LoRARequest | None = None) -> PreparedRequest:
        """Tokenize and validate; touches no state, so it may run in a worker thread."""
        if lora_request is not None and not self.enable_lora:
            raise ValueError("lora_request names an adapter, but LoRA adapters are not enabled (enable_lora)")
        if params.kv_transfer_params is not None:
            check_kv_transfer_params(params, self.kv_transfer)
        processed = self.processor.tokenize_prompt(prompt, params.truncate_prompt_tokens)
        params, engine_requests = self.processor.process(request_id, processed, params, priority, lora_request=lora_request)
        if params.structured_outputs is not None:
            self.grammars.compile_within(params.structured_outputs, self.structure_time_limit_s)
        return PreparedRequest(request_id, processed, params, engine_requests)

    def track(self, prepared: PreparedRequest) -> list[EngineCoreRequest]:
        """Start following a prepared request's outputs; returns its engine requests to send."""
        self.output_processor.add_request(prepared.request_id, prepared.prompt.prompt, prepared.prompt.prompt_token_ids,
                                          prepared.params, [r.request_id for r in prepared.engine_requests])
        return prepared.engine_requests

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns the engine ids to abort in the core (empty if unknown)."""
        engine_ids = self.output_processor.engine_ids(request_id)
        self.output_processor.abort_request(request_id)
        return engine_ids

    def prompt_of(self, engine_request_id: str) -> str | None:
        """The prompt text of a tracked engine request (None: unknown, or given as token ids)."""
        entry = self.output_processor.engine_samples.get(engine_request_id)
        return entry[0].prompt if entry is not None else None

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        return self.output_processor.process_outputs(outputs)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()


class FrontEndAccess:
    """What LLMEngine and AsyncLLM expose of their front end."""

    front_end: FrontEnd

    @property
    def tokenizer(self):
        return self.front_end.tokenizer

    @property
    def model_info(self) -> ModelInfo:
        return self.front_end.model_info

    @property
    def max_model_len(self) -> int:
        return self.front_end.max_model_len


def check_kv_transfer_params(params: SamplingParams, kv_transfer: KVTransferConfig | None) -> None:
    """A request's kv_transfer_params ask for what this engine's connector does (ValueError naming the field)."""
    if kv_transfer is None or kv_transfer.kv_connector != "P2pConnector":
        raise ValueError("kv_transfer_params must be left out: this engine was not started with --kv-transfer-config naming the "
                         "P2pConnector")
    kv_params = params.kv_transfer_params
    if kv_params.get("do_remote_decode"):
        if not kv_transfer.saves:
            raise ValueError(f"kv_transfer_params.do_remote_decode must be false on an engine with kv_role {kv_transfer.kv_role} "
                             "(holding KV for a decode instance needs kv_producer or kv_both)")
        if params.n != 1:
            raise ValueError(f"n must be 1 with kv_transfer_params.do_remote_decode (it holds one sample's KV), got {params.n}")
    if kv_params.get("do_remote_prefill") and not kv_transfer.loads:
        raise ValueError(f"kv_transfer_params.do_remote_prefill must be false on an engine with kv_role {kv_transfer.kv_role} "
                         "(loading KV from a prefill instance needs kv_consumer or kv_both)")
