"""LLM: the offline batch API."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from pagedserve import log
from pagedserve.config import DEFAULT_MODEL, EngineConfig
from pagedserve.engine.frontend import FrontEnd
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.processor import PromptType
from pagedserve.lora_request import LoRARequest
from pagedserve.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedserve.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.scoring import cosine_similarity, score_pairs

ChatMessages = list[dict]


class LLM:
    """Generate for many prompts at once.

    >>> llm = LLM()  # SmolLM2-135M-Instruct
    >>> llm.generate(["Hello, my name is"], SamplingParams(max_tokens=16))[0].outputs[0].text
    """

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args) -> None:
        self._init(EngineConfig.from_kwargs(model=model, **engine_args))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm._init(config)
        return llm

    def _init(self, config: EngineConfig) -> None:
        log.configure_library()
        self.llm_engine = LLMEngine(config)
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() use without sampling_params: the model's generation config over SamplingParams()."""
        return self.llm_engine.front_end.default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs come back in the order of the prompts. lora_request: the LoRA adapter every prompt runs with, or one
        per prompt (None: the base model); the engine must have been made with enable_lora=True."""
        self.llm_engine.front_end.check_task("generate")
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast(sampling_params or self.get_default_sampling_params(), len(prompt_list), "sampling_params")
        return self._run_prompts(prompt_list, params_list, priority, lora_request, use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        dimensions: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (outputs.embedding), in the order of the prompts, from an engine made with
        runner="pooling" (an embedding model). truncate_prompt_tokens: embed only each prompt's last tokens;
        dimensions: a matryoshka model's embeddings shortened to their first this many values."""
        front_end = self.llm_engine.front_end
        front_end.check_task("embed")
        front_end.check_dimensions(dimensions)
        outputs = self._pool(_as_prompt_list(prompts), truncate_prompt_tokens, lora_request, use_tqdm)
        return [front_end.shortened(output, dimensions) for output in outputs]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_activation: bool = True,
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's classes (outputs.probs: each label's probability; with use_activation false, its logit), in
        the order of the prompts, from an engine made with runner="pooling" over a classification model (a
        *ForSequenceClassification checkpoint)."""
        front_end = self.llm_engine.front_end
        front_end.check_task("classify")
        outputs = self._pool(_as_prompt_list(prompts), truncate_prompt_tokens, lora_request, use_tqdm)
        return [front_end.classified(output, use_activation) for output in outputs]

    def score(
        self,
        text_1: PromptType | Sequence[PromptType],
        text_2: PromptType | Sequence[PromptType],
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """Scores of text pairs (an engine made with runner="pooling"): text_1's one text against each of text_2, or the
        two lists pair by pair; in that order. A cross-encoder (a classification model of one label) reads each pair
        together and scores it; an embedding model's score is the cosine similarity of the two texts' embeddings."""
        front_end = self.llm_engine.front_end
        front_end.check_task("score")
        first, second = _as_prompt_list(text_1), _as_prompt_list(text_2)
        pairs = score_pairs(len(first), len(second))
        if front_end.model_info.classifier is not None:
            return self._cross_encoder_scores(first, second, pairs, truncate_prompt_tokens, use_tqdm)
        embeddings = self.embed(first + second, truncate_prompt_tokens, use_tqdm)
        outputs = []
        for index, (i, j) in enumerate(pairs):
            a, b = embeddings[i], embeddings[len(first) + j]
            outputs.append(ScoringRequestOutput(str(index), a.prompt_token_ids + b.prompt_token_ids,
                                                ScoringOutput(cosine_similarity(a.outputs, b.outputs))))
        return outputs

    def _cross_encoder_scores(self, first: list[PromptType], second: list[PromptType], pairs: list[tuple[int, int]],
                              truncate_prompt_tokens: int | None, use_tqdm: bool) -> list[ScoringRequestOutput]:
        front_end = self.llm_engine.front_end
        if not all(isinstance(text, str) for text in first + second):
            raise TypeError("a cross-encoder scores texts: text_1 and text_2 must be strings")
        prompts = [front_end.pair_prompt(first[i], second[j], truncate_prompt_tokens is not None) for i, j in pairs]
        outputs = self._pool(prompts, truncate_prompt_tokens, None, use_tqdm)
        return [ScoringRequestOutput(str(index), output.prompt_token_ids, ScoringOutput(front_end.pair_score(output)))
                for index, output in enumerate(outputs)]

    def _pool(self, prompt_list: list[PromptType], truncate_prompt_tokens: int | None, lora_request,
              use_tqdm: bool) -> list[EmbeddingRequestOutput]:
        """Each prompt's pooled output (runner pooling), in their order."""
        params = [FrontEnd.embedding_params(truncate_prompt_tokens)] * len(prompt_list)
        return self._run_prompts(prompt_list, params, None, lora_request, use_tqdm)

    def _run_prompts(self, prompt_list: list[PromptType], params_list: list[SamplingParams], priority, lora_request,
                     use_tqdm: bool) -> list:
        priorities = _broadcast(list(priority) if priority is not None else 0, len(prompt_list), "priority")
        loras = _broadcast(list(lora_request) if isinstance(lora_request, Sequence) else lora_request, len(prompt_list), "lora_request")
        request_ids = []
        try:
            for prompt, params, prio, lora in zip(prompt_list, params_list, priorities, loras):
                request_id = str(next(self._request_counter))
                final_params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                self.llm_engine.add_request(request_id, prompt, final_params, priority=prio, lora_request=lora)
                request_ids.append(request_id)
            return self._run_engine(request_ids, use_tqdm)
        except BaseException:
            self.llm_engine.abort_request(request_ids)
            raise

    def chat(
        self,
        messages: ChatMessages | list[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """chat_template: a template (its text) to use instead of the model's."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.apply_chat_template(c, add_generation_prompt, chat_template_kwargs, chat_template)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def apply_chat_template(self, conversation: ChatMessages, add_generation_prompt: bool = True, kwargs: dict | None = None,
                            chat_template: str | None = None) -> list[int]:
        tokenizer = self.get_tokenizer()
        if not (chat_template or tokenizer.chat_template):
            raise ValueError("this model's tokenizer has no chat template; give chat_template, or use generate() with a "
                             "plain prompt")
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template, **(kwargs or {}))
        return tokenizer(text, add_special_tokens=False).input_ids

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(request_ids), desc="Processed prompts", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start, prompt_tokens, output_tokens = time.perf_counter(), 0, 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    prompt_tokens += len(output.prompt_token_ids)
                    if isinstance(output, RequestOutput):
                        output_tokens += sum(len(c.token_ids) for c in output.outputs)
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    progress.set_postfix_str(f"input: {prompt_tokens / elapsed:.1f} tok/s, output: {output_tokens / elapsed:.1f} tok/s")
                    progress.update(1)
        progress.close()
        return [finished[request_id] for request_id in request_ids]


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    return list(prompts)


def _broadcast(value, count: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries but there are {count} prompts")
        return list(value)
    return [value] * count
