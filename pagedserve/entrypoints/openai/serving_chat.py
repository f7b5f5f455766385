"""POST /v1/chat/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request

from pagedserve.entrypoints.openai.errors import APIError
from pagedserve.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobEntry,
    ChatMessage,
    ChatStreamChoice,
    DeltaMessage,
    TopLogprob,
    random_id,
)
from pagedserve.entrypoints.openai.serving_base import ServingBase, make_usage, merge_streams, sse, usage_of
from pagedserve.outputs import PositionLogprobs


def render_messages(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool, template_kwargs: dict | None) -> list[int]:
    """The conversation as prompt token ids, through the model's chat template."""
    if not tokenizer.chat_template:
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    conversation = [{"role": m.role, "content": _text_content(m.content)} for m in messages]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **(template_kwargs or {}))
    return tokenizer(text, add_special_tokens=False).input_ids


def _text_content(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise APIError(400, f"message content of type {part.get('type')!r} is not supported; only 'text'", param="messages")
        parts.append(part.get("text", ""))
    return "".join(parts)


class OpenAIServingChat(ServingBase):
    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request):
        self.check_model(request.model)
        if request.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if request.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        prompt_ids = render_messages(self.tokenizer, request.messages, request.add_generation_prompt, request.chat_template_kwargs)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        try:
            params = request.sampling_params(max_tokens, (request.top_logprobs or 0) if request.logprobs else None)
        except ValueError as exc:
            raise APIError.bad_request(exc, param="top_logprobs" if "logprobs" in str(exc) else None) from exc
        request_id = random_id("chatcmpl")
        added = await self.add_requests(request_id, [{"prompt_token_ids": prompt_ids}], params, request.stream, request.priority)
        if request.stream:
            return self.sse_stream(added, self._stream_events(request, request_id, added))
        output = (await self.collect_final(added, raw_request))[0]
        choices = [
            ChatCompletionChoice(index=c.index, message=AssistantMessage(content=c.text),
                                 logprobs=self._logprobs(c.token_ids, c.logprobs, request), finish_reason=c.finish_reason,
                                 stop_reason=c.stop_reason)
            for c in output.outputs
        ]
        return ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=usage_of([output]))

    async def _stream_events(self, request: ChatCompletionRequest, request_id: str, added) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices, usage=None):
            return sse(ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=choices,
                                           usage=usage).model_dump(exclude_none=True))

        completion_tokens, final = 0, None
        yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(request.n)])
        async for _, output in merge_streams(self.streams(added)):
            choices = []
            for c in output.outputs:
                if not (c.text or c.token_ids or c.finish_reason):
                    continue
                completion_tokens += len(c.token_ids)
                choices.append(ChatStreamChoice(index=c.index, delta=DeltaMessage(content=c.text),
                                                logprobs=self._logprobs(c.token_ids, c.logprobs, request),
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
            if output.finished:
                final = output
            if choices:
                yield chunk(choices)
        if request.stream_options is not None and request.stream_options.include_usage and final is not None:
            yield chunk([], make_usage(len(final.prompt_token_ids), completion_tokens))

    def _logprobs(self, token_ids: list[int], positions: list[PositionLogprobs] | None, request) -> ChatChoiceLogprobs | None:
        if not request.logprobs or positions is None:
            return None
        entries = []
        for token_id, position in zip(token_ids, positions):
            token = self.tokenizer.decode([token_id])
            top = sorted(position.items(), key=lambda item: item[1].rank)[: request.top_logprobs or 0]
            entries.append(ChatLogprobEntry(
                token=token, logprob=position[token_id].logprob, bytes=list(token.encode()),
                top_logprobs=[TopLogprob(token=(t := self.tokenizer.decode([tid])), logprob=lp.logprob, bytes=list(t.encode()))
                              for tid, lp in top],
            ))
        return ChatChoiceLogprobs(content=entries)
