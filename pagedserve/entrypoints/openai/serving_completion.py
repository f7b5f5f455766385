"""POST /v1/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request

from pagedserve.entrypoints.openai.errors import APIError
from pagedserve.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    random_id,
)
from pagedserve.entrypoints.openai.serving_base import ServingBase, make_usage, merge_streams, prompt_list, sse, usage_of
from pagedserve.outputs import PositionLogprobs, RequestOutput


class OpenAIServingCompletion(ServingBase):
    async def create_completion(self, request: CompletionRequest, raw_request: Request):
        lora_request = self.check_model(request.model)
        self.check_n(request.n)
        self._reject_unsupported(request)
        prompts = prompt_list(request.prompt, "prompt")
        try:
            params = request.sampling_params(request.max_tokens, request.logprobs, self.default_params)
            if request.echo and request.logprobs is not None:
                params.prompt_logprobs = request.logprobs
        except ValueError as exc:
            raise APIError.bad_request(exc) from exc
        request_id = random_id("cmpl")
        added = await self.add_requests(request_id, prompts, params, request.stream, request.priority, request.structure_field(),
                                        lora_request)
        if request.stream:
            return self.sse_stream(added, self._stream_events(request, request_id, added), raw_request)
        outputs = await self.collect_final(added, raw_request)
        choices = [
            self._choice(prompt_index * request.n + c.index, output, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason,
                         request, echo=request.echo)
            for prompt_index, output in enumerate(outputs)
            for c in output.outputs
        ]
        return CompletionResponse(id=request_id, model=self.models.response_name(request.model), choices=choices, usage=usage_of(outputs),
                                  kv_transfer_params=outputs[0].kv_transfer_params)

    def _reject_unsupported(self, request: CompletionRequest) -> None:
        if request.suffix is not None:
            raise APIError(400, "suffix is not supported", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise APIError(400, "best_of is not supported (it must equal n when given)", param="best_of")

    async def _stream_events(self, request: CompletionRequest, request_id: str, added) -> AsyncIterator[str]:
        created, model = int(time.time()), self.models.response_name(request.model)
        finals: dict[int, RequestOutput] = {}
        echoed: set[int] = set()
        token_counts: dict[int, int] = {}
        async for prompt_index, output in merge_streams(self.streams(added)):
            choices = []
            for c in output.outputs:
                index = prompt_index * request.n + c.index
                echo = request.echo and index not in echoed
                if not (c.text or c.token_ids or c.finish_reason or echo):
                    continue
                echoed.add(index)
                token_counts[index] = token_counts.get(index, 0) + len(c.token_ids)
                choices.append(self._choice(index, output, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason,
                                            request, echo=echo))
            if output.finished:
                finals[prompt_index] = output
            if choices:
                yield sse(CompletionChunk(id=request_id, created=created, model=model, choices=choices).model_dump_json())
        if request.stream_options is not None and request.stream_options.include_usage:
            usage = make_usage(sum(len(o.prompt_token_ids) for o in finals.values()), sum(token_counts.values()))
            yield sse(CompletionChunk(id=request_id, created=created, model=model, choices=[], usage=usage).model_dump_json())

    def _choice(self, index, output: RequestOutput, text, token_ids, logprobs, finish_reason, stop_reason, request, echo: bool):
        prompt_text = ""
        if echo:
            prompt_text = output.prompt if output.prompt is not None else self.tokenizer.decode(output.prompt_token_ids)
        choice_logprobs = None
        if request.logprobs is not None:
            choice_logprobs = CompletionLogProbs()
            if echo:
                self._append_logprobs(choice_logprobs, output.prompt_token_ids, output.prompt_logprobs or [], 0)
            self._append_logprobs(choice_logprobs, token_ids, logprobs or [], len(prompt_text))
        return CompletionChoice(index=index, text=prompt_text + text, logprobs=choice_logprobs, finish_reason=finish_reason,
                                stop_reason=stop_reason)

    def _append_logprobs(self, target: CompletionLogProbs, token_ids: list[int], positions: list[PositionLogprobs | None],
                         offset: int) -> None:
        offset = offset if not target.text_offset else target.text_offset[-1] + len(target.tokens[-1])
        for token_id, position in zip(token_ids, positions):
            token = self.token_text(token_id)
            target.tokens.append(token)
            target.text_offset.append(offset)
            offset += len(token)
            if position is None:  # the first prompt token has no logprob
                target.token_logprobs.append(None)
                target.top_logprobs.append(None)
                continue
            target.token_logprobs.append(self.api_logprob(position[token_id].logprob))
            target.top_logprobs.append({self.token_text(tid): self.api_logprob(lp.logprob) for tid, lp in position.items()})
