"""POST /v1/responses, GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items and POST
/v1/responses/{id}/cancel: the Responses API over the chat endpoint. A request's input (after the stored conversation
its previous_response_id names) becomes a chat completion request, which the chat endpoint checks, renders and runs
(serving_chat.py: the same template, tools and structures); its text and tool calls come back as output items, whole,
as the API's stream of events, or, run in the background, in the stored response once done (streamed too, its events
kept for clients that read them again)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from pydantic import ValidationError

from pagedserve.entrypoints.openai.errors import APIError
from pagedserve.entrypoints.openai.event_log import EventLog
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, DeltaMessage
from pagedserve.entrypoints.openai.responses_protocol import (
    DeletedResponse,
    FunctionCallOutput,
    IncompleteDetails,
    InputItemList,
    InputTokensDetails,
    ListedItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningOutput,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
    conversation_of,
    fitting_turns,
    listed_item,
)
from pagedserve.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from pagedserve.entrypoints.openai.serving_base import sse, stream_failure
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.tool_calls import ToolPlan
from pagedserve.outputs import RequestOutput

# The chat request's fields that a chat-side error names, as this endpoint's request names them.
_FIELD_NAMES = {"messages": "input", "response_format": "text.format", "max_completion_tokens": "max_output_tokens"}


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store
        self._background: dict[str, tuple[asyncio.Task, _Run]] = {}  # background responses still running, by id

    async def create_response(self, request: ResponsesRequest, raw_request: Request):
        _check_combination(request, self.store)
        if request.wants_logprobs and self.chat.reasoning_parser is not None:
            raise APIError(400, "message.output_text.logprobs are given for an output that is all text: not on a server that "
                                "sets reasoning apart (--reasoning-parser)", param="include")
        previous = self._previous(request.previous_response_id)
        own_items = request.input_items()
        conversation = (previous.conversation if previous else []) + conversation_of(own_items)
        input_items = (previous.input_items + previous.response.output if previous else []) + [listed_item(item) for item in own_items]
        response = self._new_response(request)
        try:
            chat_request, prompt_ids = await self._as_chat_request(request, conversation)
            added, tools = await self.chat.start(chat_request, response.id, prompt_ids)
        except APIError as exc:
            raise _renamed(exc) from exc
        response.tool_choice = _tool_choice(tools)
        run = _Run(response, added, tools, conversation, input_items, chat_request)
        if request.background:
            return self._run_in_background(run, streamed=request.stream)
        if request.stream:
            events = _ResponseEvents(self, run)
            return self.chat.sse_stream(added, events.stream(), raw_request, error_event=events.error)
        return await self._answer(run, raw_request)

    def _run_in_background(self, run: _Run, streamed: bool):
        """Stored at once, without a conversation to continue from until it is done, and run by a task of the server's:
        the response in progress, or, streamed, its events as they come (kept, so that a client that went away can
        read them again)."""
        response = run.response
        events = EventLog() if streamed else None
        self.store.put(response, run.input_items, None, events)
        task = asyncio.ensure_future(self._record(run, events) if streamed else self._answer(run, raw_request=None))
        self._background[response.id] = task, run
        task.add_done_callback(lambda _: self._background.pop(response.id, None))
        return events.read(0) if streamed else response

    async def _record(self, run: _Run, log: EventLog) -> None:
        """A streamed background response's events into its log; a failure ends it with the API's error event."""
        events = _ResponseEvents(self, run)
        try:
            async for event in events.stream():
                log.append(event)
        except Exception as exc:
            status, message = stream_failure(exc, run.response.id)
            _fail(run.response, message)
            log.append(events.error(status, message))
        finally:
            log.close()

    async def _answer(self, run: _Run, raw_request: Request | None) -> ResponseObject:
        """The response once its request has run (raw_request: the client's, whose going away aborts it; None for a
        background response, which a failure of the engine leaves failed)."""
        response = run.response
        try:
            output = (await self.chat.collect_final(run.added, raw_request))[0]
        except Exception as exc:  # the client's request fails with it; a background response records it
            if raw_request is not None:
                raise
            _fail(response, stream_failure(exc, response.id)[1])
            return response
        completion = output.outputs[0]
        reply = run.tools.reply(completion.text, completion.finish_reason)
        items: list[ReasoningOutput | OutputMessage | FunctionCallOutput] = []
        if reply.reasoning is not None:
            items.append(ReasoningOutput(content=[ReasoningText(text=reply.reasoning)]))
        if reply.content or not (reply.tool_calls or items):  # a message, empty if nothing else was said
            logprobs = self.text_logprobs(completion.token_ids, completion.logprobs, run.chat_request)
            items.append(OutputMessage(content=[OutputText(text=reply.content or "", logprobs=logprobs)]))
        items.extend(FunctionCallOutput(call_id=call.id, name=call.function.name, arguments=call.function.arguments)
                     for call in reply.tool_calls)
        await self.finish(run, items, output, completion.token_ids)
        return response

    def _new_response(self, request: ResponsesRequest) -> ResponseObject:
        """The response, in progress: what the request asked, as the API echoes it."""
        return ResponseObject(
            model=self.chat.models.response_name(request.model), instructions=request.instructions,
            max_output_tokens=request.max_output_tokens, parallel_tool_calls=request.parallel_tool_calls, top_logprobs=request.top_logprobs,
            previous_response_id=request.previous_response_id, store=request.store, temperature=request.temperature,
            top_p=request.top_p, user=request.user, metadata=request.metadata or {}, truncation=request.truncation or "disabled",
            background=bool(request.background), text=(request.text or TextConfig()).model_dump(by_alias=True),
            tools=[tool.model_dump(exclude_none=True) for tool in request.tools or []],
        )

    async def _as_chat_request(self, request: ResponsesRequest, conversation: list[dict]) -> tuple[ChatCompletionRequest, list[int] | None]:
        """The chat request the response runs as, and its prompt where this had to measure it: of the whole conversation,
        or with truncation auto, of its longest tail whose prompt leaves max_output_tokens (or one token) of room in
        the model's context (the instructions kept). Each tail tried is rendered once; most conversations fit whole."""
        whole = _chat_request(request, conversation)
        if request.truncation != "auto":
            return whole, None
        limit = self.chat.engine.max_model_len - (request.max_output_tokens or 1)
        measured: dict[int, tuple[ChatCompletionRequest, list[int]]] = {}

        async def fits(start: int) -> bool:
            if start not in measured:
                chat_request = whole if start == 0 else _chat_request(request, conversation[start:])
                measured[start] = chat_request, await self.chat.prompt_of(chat_request)
            return len(measured[start][1]) <= limit

        start = 0 if await fits(0) else await fitting_turns(conversation, fits)
        await fits(start)  # measured, where the search did not try it (the last turn, when none fits)
        return measured[start]

    def text_logprobs(self, token_ids: list[int], positions, chat_request: ChatCompletionRequest) -> list[dict]:
        """The tokens' logprobs as an output text carries them (each token, its logprob and bytes, and the top_logprobs
        alternatives): the chat endpoint's entries, in the same form. Empty where the request did not include them."""
        logprobs = self.chat.choice_logprobs(token_ids, positions, chat_request)
        return [entry.model_dump(mode="json") for entry in logprobs.content] if logprobs is not None else []

    def get(self, response_id: str) -> ResponseObject:
        return self._stored(response_id).response

    def stream_again(self, response_id: str, starting_after: int | None) -> AsyncIterator[str]:
        """A streamed background response's events after the one numbered starting_after (from the first without it),
        those still to come included."""
        events = self._stored(response_id).events
        if events is None:
            raise APIError(409, "only a response created with background and stream true can be streamed again", param="stream")
        return events.read(0 if starting_after is None else starting_after + 1)

    def input_items(self, response_id: str, after: str | None, limit: int, order: str, with_logprobs: bool) -> InputItemList:
        """A page of the items that went into a stored response, in the order asked (desc: the latest first), the
        limit's number of them from the one after the item named `after`; output texts' logprobs only if asked."""
        items = self._stored(response_id).input_items
        if order == "desc":
            items = items[::-1]
        start = 0
        if after is not None:
            start = next((index + 1 for index, item in enumerate(items) if item.id == after), None)
            if start is None:
                raise APIError(404, f"after {after!r} names no input item of response {response_id!r}", param="after")
        page = [_as_listed(item, with_logprobs) for item in items[start:start + limit]]
        return InputItemList(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None,
                             has_more=start + limit < len(items))

    async def cancel(self, response_id: str) -> ResponseObject:
        """Stop a background response that is still running (its status then cancelled); one that has ended is returned
        as it ended."""
        response = self._stored(response_id).response
        if not response.background:
            raise APIError(409, "only a response created with background true can be cancelled", param="response_id")
        await self._stop(response)
        return response

    async def delete(self, response_id: str) -> DeletedResponse:
        await self._stop(self._stored(response_id).response)
        self.store.delete(response_id)
        return DeletedResponse(id=response_id)

    def _stored(self, response_id: str):
        stored = self.store.get(response_id)
        if stored is None:
            raise APIError(404, f"no stored response has the id {response_id!r}", param="response_id")
        return stored

    async def _stop(self, response: ResponseObject) -> None:
        """Cancel the response's background run, if it has one still going, and abort its requests."""
        running = self._background.pop(response.id, None)
        if running is None:
            return
        task, run = running
        task.cancel()
        for sub_id, _ in run.added:
            await self.chat.engine.abort(sub_id)
        response.status = "cancelled"

    async def finish(self, run: _Run, items: list, output: RequestOutput, token_ids: list[int]) -> None:
        """The run's response as it ended (output: the request's last output; token_ids: all it generated), with
        these output items; kept if the request asked."""
        response = run.response
        cut = output.outputs[0].finish_reason == "length"
        status = "incomplete" if cut else "completed"
        for item in items:
            item.status = status
        response.output = items
        response.status = status
        response.incomplete_details = IncompleteDetails(reason="max_output_tokens") if cut else None
        input_tokens = len(output.prompt_token_ids)
        cached = InputTokensDetails(cached_tokens=output.num_cached_tokens)
        output_tokens = len(token_ids)
        reasoning_tokens = await self.chat.reasoning_tokens(run.tools, token_ids)
        response.usage = ResponseUsage(input_tokens=input_tokens, input_tokens_details=cached, output_tokens=output_tokens,
                                       output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
                                       total_tokens=input_tokens + output_tokens)
        if response.store:
            self.store.put(response, run.input_items, run.conversation + conversation_of([item.as_input() for item in items]))

    def _previous(self, previous_response_id: str | None) -> StoredResponse | None:
        """The stored response a request continues, which must have ended."""
        if previous_response_id is None:
            return None
        stored = self.store.get(previous_response_id)
        if stored is None:
            raise APIError(404, f"previous_response_id {previous_response_id!r} names no stored response (it was not stored, "
                                "or the server has dropped it)", param="previous_response_id")
        if stored.conversation is None:
            raise APIError(409, f"previous_response_id {previous_response_id!r} names a background response that has not "
                                "completed", param="previous_response_id")
        return stored


class _ResponseEvents:
    """One streamed response: its text deltas and tool calls as the API's events, each numbered in order."""

    def __init__(self, serving: OpenAIServingResponses, run: _Run) -> None:
        self.serving, self.run, self.response = serving, run, run.response
        # Logprobs of the tokens whose text has not been sent yet: they go with the next text delta (or, at the end, with
        # the text's done event).
        self.pending_logprobs: list[dict] = []
        self.text_stream = run.tools.stream()
        self.sequence_number = 0
        self.items: list[ReasoningOutput | OutputMessage | FunctionCallOutput] = []
        self.reasoning: ReasoningOutput | None = None  # the reasoning item streaming, if any
        self.message: OutputMessage | None = None  # the message whose text is streaming, if any
        self.calls: dict[int, FunctionCallOutput] = {}  # by the index the chat stream gives each call

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\n" + sse(payload)

    def error(self, status: int, message: str, param: str | None = None) -> str:
        return self.event("error", code=str(status), message=message, param=param)

    async def stream(self) -> AsyncIterator[str]:
        response = self.response
        yield self.event("response.created", response=response.model_dump(mode="json"))
        yield self.event("response.in_progress", response=response.model_dump(mode="json"))
        final, token_ids = None, []
        async for output in self.serving.chat.streams(self.run.added)[0]:
            completion = output.outputs[0]
            token_ids += completion.token_ids
            self.pending_logprobs += self.serving.text_logprobs(completion.token_ids, completion.logprobs, self.run.chat_request)
            for event in self._deltas(self.text_stream.feed(completion.text)):
                yield event
            if completion.finish_reason is not None:
                last_deltas, _ = self.text_stream.finish(completion.finish_reason)
                for delta in last_deltas:
                    for event in self._deltas(delta):
                        yield event
            if output.finished:
                final = output
        if not self.items:  # nothing said: an empty message, as a response that is not streamed has
            for event in self._text_events(""):
                yield event
        status = "incomplete" if final.outputs[0].finish_reason == "length" else "completed"
        for event in self._close_reasoning(status) + self._close_message(status):
            yield event
        for call in self.calls.values():
            call.status = status
            yield self.event("response.function_call_arguments.done", item_id=call.id, output_index=self._index(call),
                             arguments=call.arguments)
            yield self.event("response.output_item.done", output_index=self._index(call), item=call.model_dump(mode="json"))
        await self.serving.finish(self.run, self.items, final, token_ids)
        yield self.event(f"response.{status}", response=response.model_dump(mode="json"))

    def _deltas(self, delta: DeltaMessage | None) -> list[str]:
        if delta is None:
            return []
        events = self._reasoning_events(delta.reasoning) if delta.reasoning else []
        if delta.content or delta.tool_calls:  # the answer has begun: the reasoning is done
            events.extend(self._close_reasoning("completed"))
        if delta.content:
            events.extend(self._text_events(delta.content))
        for call_delta in delta.tool_calls or []:
            call = self.calls.get(call_delta.index)
            if call is None:
                events.extend(self._close_message("completed"))
                call = self.calls[call_delta.index] = FunctionCallOutput(call_id=call_delta.id, name=call_delta.function.name,
                                                                         status="in_progress")
                self.items.append(call)
                events.append(self.event("response.output_item.added", output_index=self._index(call), item=call.model_dump(mode="json")))
            if call_delta.function.arguments:
                call.arguments += call_delta.function.arguments
                events.append(self.event("response.function_call_arguments.delta", item_id=call.id, output_index=self._index(call),
                                         delta=call_delta.function.arguments))
        return events

    def _text_events(self, text: str) -> list[str]:
        events = []
        if self.message is None:
            self.message = OutputMessage(status="in_progress")
            self.items.append(self.message)
            events.append(self.event("response.output_item.added", output_index=self._index(self.message),
                                     item=self.message.model_dump(mode="json")))
            self.message.content.append(OutputText(text=""))
            events.append(self.event("response.content_part.added", item_id=self.message.id, output_index=self._index(self.message),
                                     content_index=0, part=self.message.content[0].model_dump(mode="json")))
        if text:
            part, logprobs, self.pending_logprobs = self.message.content[0], self.pending_logprobs, []
            part.text += text
            part.logprobs += logprobs
            events.append(self.event("response.output_text.delta", item_id=self.message.id, output_index=self._index(self.message),
                                     content_index=0, delta=text, logprobs=logprobs))
        return events

    def _reasoning_events(self, text: str) -> list[str]:
        events = []
        if self.reasoning is None:
            self.reasoning = ReasoningOutput(status="in_progress", content=[ReasoningText(text="")])
            self.items.append(self.reasoning)
            events.append(self.event("response.output_item.added", output_index=self._index(self.reasoning),
                                      item=self.reasoning.model_dump(mode="json")))
        self.reasoning.content[0].text += text
        events.append(self.event("response.reasoning_text.delta", item_id=self.reasoning.id, output_index=self._index(self.reasoning),
                                 content_index=0, delta=text))
        return events

    def _close_reasoning(self, status: str) -> list[str]:
        item = self.reasoning
        if item is None:
            return []
        self.reasoning = None
        where = self._ended(item, status)
        return [self.event("response.reasoning_text.done", **where, text=item.content[0].text), self._item_done(item)]

    def _close_message(self, status: str) -> list[str]:
        message = self.message
        if message is None:
            return []
        self.message = None
        where = self._ended(message, status)
        part = message.content[0]
        part.logprobs += self.pending_logprobs
        self.pending_logprobs = []
        return [self.event("response.output_text.done", **where, text=part.text, logprobs=part.logprobs),
                self.event("response.content_part.done", **where, part=part.model_dump(mode="json")), self._item_done(message)]

    def _ended(self, item, status: str) -> dict:
        """The item with its final status; where its closing events point (its first content part)."""
        item.status = status
        return {"item_id": item.id, "output_index": self._index(item), "content_index": 0}

    def _item_done(self, item) -> str:
        return self.event("response.output_item.done", output_index=self._index(item), item=item.model_dump(mode="json"))

    def _index(self, item) -> int:
        return next(index for index, candidate in enumerate(self.items) if candidate is item)


@dataclass
class _Run:
    """A response being answered: what its chat request added to the engine, and what turns its output into items."""

    response: ResponseObject
    added: list  # its sub-requests, as add_requests gives them
    tools: ToolPlan
    conversation: list[dict]  # what it answers (whole, however truncation cut what ran)
    input_items: list[ListedItem]  # the same, as the API's items
    chat_request: ChatCompletionRequest


def _fail(response: ResponseObject, message: str) -> None:
    """A background response whose run failed: so it reads back (the message says no more than the client may know)."""
    response.status, response.error = "failed", {"code": "server_error", "message": message}


def _check_combination(request: ResponsesRequest, store: ResponseStore) -> None:
    """The rules between fields and the server's settings that the request's own checks cannot see."""
    if request.store and store.max_responses == 0:
        raise APIError(400, "this server keeps no responses (--max-stored-responses 0): give store false", param="store")
    if request.background and not request.store:
        raise APIError(400, "a background response is stored and read back when done: give store true", param="background")
    if request.wants_logprobs and request.tools and request.tool_choice != "none":
        raise APIError(400, "message.output_text.logprobs are given for a response that is text alone: not with tools "
                            "the model may call (tool_choice other than none)", param="include")


def _chat_request(request: ResponsesRequest, conversation: list[dict]) -> ChatCompletionRequest:
    system = [{"role": "system", "content": request.instructions}] if request.instructions is not None else []
    try:
        return ChatCompletionRequest.model_validate({**request.chat_fields(), "messages": system + conversation})
    except ValidationError as exc:  # the request's own fields were checked: what is left is how they combine
        raise APIError(400, f"the input cannot be run as a conversation: {exc.errors()[0]['msg']}", param="input") from exc


def _tool_choice(tools: ToolPlan) -> str | dict:
    """The tool choice the response ran with, as the API echoes it."""
    return {"type": "function", "name": tools.function_name} if tools.mode == "named" else tools.mode


def _renamed(exc: APIError) -> APIError:
    """A chat-side error, naming the field as this endpoint's request does."""
    if exc.param is None:
        return exc
    head, dot, rest = exc.param.partition(".")
    if head in _FIELD_NAMES:
        exc.param = _FIELD_NAMES[head] + dot + rest
    return exc


def _as_listed(item: ListedItem, with_logprobs: bool) -> ListedItem:
    """The item as a page lists it: an earlier output message's logprobs only where the listing asks for them."""
    if with_logprobs or not isinstance(item, OutputMessage) or not any(part.logprobs for part in item.content):
        return item
    return item.model_copy(update={"content": [part.model_copy(update={"logprobs": []}) for part in item.content]})
