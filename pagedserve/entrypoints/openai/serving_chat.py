"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

from fastapi import Request

from pagedserve.entrypoints.openai.chat_template import ChatTemplateRenderer
from pagedserve.entrypoints.openai.errors import APIError
from pagedserve.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobEntry,
    ChatStreamChoice,
    CompletionTokensDetails,
    DeltaMessage,
    TopLogprob,
    random_id,
)
from pagedserve.entrypoints.openai.reasoning import REASONING_PARSERS
from pagedserve.entrypoints.openai.serving_base import ServingBase, make_usage, merge_streams, sse, usage_of
from pagedserve.entrypoints.openai.serving_models import ServingModels
from pagedserve.entrypoints.openai.tool_calls import ToolPlan
from pagedserve.outputs import PositionLogprobs


class OpenAIServingChat(ServingBase):
    def __init__(self, engine, models: ServingModels, max_n: int, renderer: ChatTemplateRenderer,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None) -> None:
        """tool_call_parser: the format tool_choice "auto" reads calls in (None: "auto" is refused); reasoning_parser:
        how the output splits into reasoning and answer (None: it is all answer)."""
        super().__init__(engine, models, max_n)
        self.renderer = renderer
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = REASONING_PARSERS[reasoning_parser] if reasoning_parser is not None else None

    def prompt_token_ids(self, messages, add_generation_prompt: bool, chat_template: str | None, template_kwargs: dict | None,
                         tools: list[dict] | None = None) -> list[int]:
        """The conversation as prompt token ids. Blocking: run it in a worker thread."""
        text = self.renderer.render(messages, add_generation_prompt, chat_template, template_kwargs, tools)
        try:  # the template writes any special tokens itself
            return self.engine.front_end.processor.tokenize_text(text, add_special_tokens=False)
        except ValueError as exc:
            raise APIError.bad_request(exc, param="messages") from exc

    async def prompt_of(self, request: ChatCompletionRequest) -> list[int]:
        """The request's conversation as the prompt it runs as (rendered with its template and tools, tokenized)."""
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
        return await asyncio.to_thread(self.prompt_token_ids, request.messages, request.add_generation_prompt, request.chat_template,
                                       request.chat_template_kwargs, tools)

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request):
        request_id = random_id("chatcmpl")
        added, tools = await self.start(request, request_id)
        if request.stream:
            return self.sse_stream(added, self._stream_events(request, request_id, added, tools), raw_request)
        output = (await self.collect_final(added, raw_request))[0]
        choices = []
        for c in output.outputs:
            reply = tools.reply(c.text, c.finish_reason)
            message = AssistantMessage(content=reply.content, reasoning=reply.reasoning, tool_calls=reply.tool_calls)
            choices.append(ChatCompletionChoice(index=c.index, message=message,
                                                logprobs=self.choice_logprobs(c.token_ids, c.logprobs, request),
                                                finish_reason=reply.finish_reason, stop_reason=c.stop_reason))
        usage = usage_of([output])
        usage.completion_tokens_details = await self._reasoning_details(tools, [c.token_ids for c in output.outputs])
        return ChatCompletionResponse(id=request_id, model=self.models.response_name(request.model), choices=choices,
                                      usage=usage, kv_transfer_params=output.kv_transfer_params)

    async def start(self, request: ChatCompletionRequest, request_id: str, prompt_ids: list[int] | None = None) -> tuple[list, ToolPlan]:
        """Check the request, render its conversation and add its samples to the engine: -> (the sub-requests added, as
        add_requests gives them; how its text becomes tool calls). prompt_ids: the conversation as prompt_of gave it,
        where the caller has rendered it already. Raises APIError naming the field at fault."""
        lora_request = self.check_model(request.model)
        self.check_n(request.n)
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        if request.max_tokens is not None and request.max_completion_tokens is not None:
            raise APIError(400, "give max_completion_tokens or its older name max_tokens, not both", param="max_tokens")
        tools = ToolPlan.of(request, self.tool_call_parser, self.reasoning_parser)
        if prompt_ids is None:
            prompt_ids = await self.prompt_of(request)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        try:
            params = request.sampling_params(max_tokens, (request.top_logprobs or 0) if request.logprobs else None,
                                             self.default_params)
            if tools.structure is not None:
                params = dataclasses.replace(params, structured_outputs=tools.structure)
        except ValueError as exc:
            raise APIError.bad_request(exc, param="top_logprobs" if "logprobs" in str(exc) else None) from exc
        added = await self.add_requests(request_id, [{"prompt_token_ids": prompt_ids}], params, request.stream, request.priority,
                                        "tools" if tools.structure is not None else request.structure_field(), lora_request)
        return added, tools

    async def _stream_events(self, request: ChatCompletionRequest, request_id: str, added, tools: ToolPlan) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices, usage=None):
            return sse(ChatCompletionChunk(id=request_id, created=created, model=self.models.response_name(request.model), choices=choices,
                                           usage=usage).model_dump_json(exclude_none=True))

        final = None
        streams = [tools.stream() for _ in range(request.n)]
        token_ids: list[list[int]] = [[] for _ in range(request.n)]  # each choice's, for the usage
        yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(request.n)])
        async for _, output in merge_streams(self.streams(added)):
            choices = []
            for c in output.outputs:
                if not (c.text or c.token_ids or c.finish_reason):
                    continue
                token_ids[c.index] += c.token_ids
                stream = streams[c.index]
                delta = stream.feed(c.text)
                logprobs = self.choice_logprobs(c.token_ids, c.logprobs, request)
                if c.finish_reason is None:
                    if delta is not None or logprobs is not None:
                        choices.append(ChatStreamChoice(index=c.index, delta=delta or DeltaMessage(), logprobs=logprobs))
                    continue
                last_deltas, finish_reason = stream.finish(c.finish_reason)
                deltas = [d for d in (delta, *last_deltas) if d is not None] or [DeltaMessage()]
                choices.extend(ChatStreamChoice(index=c.index, delta=d) for d in deltas[:-1])
                choices.append(ChatStreamChoice(index=c.index, delta=deltas[-1], logprobs=logprobs, finish_reason=finish_reason,
                                                stop_reason=c.stop_reason))
            if output.finished:
                final = output
            if choices:
                yield chunk(choices)
        if request.stream_options is not None and request.stream_options.include_usage and final is not None:
            usage = make_usage(len(final.prompt_token_ids), sum(len(ids) for ids in token_ids))
            usage.completion_tokens_details = await self._reasoning_details(tools, token_ids)
            yield chunk([], usage)

    async def _reasoning_details(self, tools: ToolPlan, token_ids: list[list[int]]) -> CompletionTokensDetails | None:
        """How many of the choices' tokens were reasoning, where the output had reasoning set apart."""
        if tools.reasoning is None:
            return None
        return CompletionTokensDetails(reasoning_tokens=sum([await self.reasoning_tokens(tools, ids) for ids in token_ids]))

    async def reasoning_tokens(self, tools: ToolPlan, token_ids: list[int]) -> int:
        """How many of an output's tokens were reasoning (0 where none was set apart). Its text is decoded a few times,
        in a worker thread, so the server's event loop goes on meanwhile."""
        if tools.reasoning is None:
            return 0
        return await asyncio.to_thread(tools.reasoning.reasoning_tokens, token_ids, self.engine.tokenizer.decode)

    def choice_logprobs(self, token_ids: list[int], positions: list[PositionLogprobs] | None, request) -> ChatChoiceLogprobs | None:
        """The tokens' logprobs as a chat choice gives them (None where the request asked for none)."""
        if not request.logprobs or positions is None:
            return None
        entries = []
        for token_id, position in zip(token_ids, positions):
            token = self.token_text(token_id)
            top = sorted(position.items(), key=lambda item: item[1].rank)[: request.top_logprobs or 0]
            entries.append(ChatLogprobEntry(
                token=token, logprob=self.api_logprob(position[token_id].logprob), bytes=list(token.encode()),
                top_logprobs=[TopLogprob(token=(t := self.token_text(tid)), logprob=self.api_logprob(lp.logprob), bytes=list(t.encode()))
                              for tid, lp in top],
            ))
        return ChatChoiceLogprobs(content=entries)
