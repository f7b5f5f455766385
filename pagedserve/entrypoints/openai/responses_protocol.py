"""The Responses API's request and response bodies (POST /v1/responses), and how a request's input becomes the chat
conversation the chat endpoint renders: instructions as the system message, messages as they are, a function call as
the assistant's tool call and its output as the tool's answer. Checked as strictly as the other endpoints' bodies
(protocol.py): a field or an input item of a kind this server does not know is refused by name."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from pagedserve.entrypoints.openai.protocol import (
    Count,
    JSONObjectFormat,
    NonEmpty,
    RequestBody,
    StrictModel,
    TextFormat,
    bounded,
    output_format,
    random_id,
)

# What a function's name may be (as chat completions' tools say).
FUNCTION_NAME = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
# Metadata: at most 16 pairs, keys of up to 64 characters, values of up to 512 (OpenAI's limits).
MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class InputText(StrictModel):
    type: Literal["input_text"]
    text: str


class OutputTextPart(StrictModel):
    """An assistant message's text, as an earlier response gave it back."""

    type: Literal["output_text"]
    text: str
    # As the output gave them (none, here), given back with it: they say nothing of what to do now.
    annotations: list[Any] = Field(default_factory=list, max_length=0)
    logprobs: list[Any] | None = None


def _part_kind(value) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"{kind}-branch" if kind in ("input_text", "output_text") else None


ContentPart = Annotated[
    Annotated[InputText, Tag("input_text-branch")] | Annotated[OutputTextPart, Tag("output_text-branch")],
    Discriminator(_part_kind, custom_error_type="content_part_type",
                  custom_error_message="content parts of type input_text and output_text are supported; no other"),
]


class InputMessage(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | NonEmpty[list[ContentPart]]
    # What an output message of an earlier response carries besides (given back as it came).
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(StrictModel):
    """A call the model made in an earlier turn."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = FUNCTION_NAME
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(StrictModel):
    """What a call returned: the tool's answer to it."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningTextPart(StrictModel):
    type: Literal["reasoning_text"]
    text: str


class SummaryTextPart(StrictModel):
    type: Literal["summary_text"]
    text: str


class ReasoningInputItem(StrictModel):
    """An earlier response's reasoning, given back as it came. It is not part of the conversation the model sees next
    (reasoning models' templates leave earlier turns' reasoning out)."""

    type: Literal["reasoning"]
    summary: list[SummaryTextPart]
    content: list[ReasoningTextPart] | None = None
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    encrypted_content: str | None = None  # another server's: left out with the rest of the item


_ITEM_KINDS = ("message", "function_call", "function_call_output", "reasoning")


def _item_kind(value) -> str | None:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return f"{kind}-branch" if kind in _ITEM_KINDS else None


InputItem = Annotated[
    Annotated[InputMessage, Tag("message-branch")] | Annotated[FunctionCallItem, Tag("function_call-branch")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output-branch")] | Annotated[ReasoningInputItem, Tag("reasoning-branch")],
    Discriminator(_item_kind, custom_error_type="input_item_type",
                  custom_error_message="input items of type message, function_call, function_call_output and reasoning are "
                                       "supported; no other"),
]


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str = FUNCTION_NAME
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; none: any object
    strict: bool | None = None  # a forced call always follows its parameters, strict or not


class NamedFunctionChoice(StrictModel):
    type: Literal["function"]
    name: str = Field(min_length=1)


class JSONSchemaTextFormat(StrictModel):
    type: Literal["json_schema"]
    name: str = FUNCTION_NAME
    json_schema: dict[str, Any] = Field(alias="schema")
    description: str | None = None  # what the format is for; not shown to the model
    strict: bool | None = None  # the output always follows the schema, strict or not


TextFormatChoice = output_format(JSONSchemaTextFormat, "text_format_type")


class TextConfig(StrictModel):
    format: TextFormatChoice = Field(default_factory=lambda: TextFormat(type="text"))


# Rules between fields, as the server applies them: a tool_choice other than none needs tools; one that forces a call
# gives the output's structure, which text.format then does not; a background response is stored;
# logprobs are included for a response of text alone (no tools, or tool_choice none).
_FORCES_A_CALL = {"anyOf": [{"const": "required"}, {"type": "object"}]}
_RULES = [
    {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {"anyOf": [{"enum": ["auto", "required"]}, {"type": "object"}]}}},
     "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}},
    {"if": {"required": ["tool_choice"], "properties": {"tool_choice": _FORCES_A_CALL}},
     "then": {"properties": {"text": {"anyOf": [{"type": "null"},
                                                {"properties": {"format": {"properties": {"type": {"const": "text"}}}}}]}}}},
    {"if": {"required": ["background"], "properties": {"background": {"const": True}}},
     "then": {"properties": {"store": {"const": True}}}},
    {"if": {"required": ["include"],
            "properties": {"include": {"type": "array", "contains": {"const": "message.output_text.logprobs"}}}},
     "then": {"anyOf": [{"not": {"required": ["tools"]}}, {"properties": {"tools": {"anyOf": [{"type": "null"}, {"maxItems": 0}]}}},
                        {"required": ["tool_choice"], "properties": {"tool_choice": {"const": "none"}}}]}},
]


# What a request (or a listing of input items) may ask to include: each output text's token logprobs.
Includable = Literal["message.output_text.logprobs"]


class ResponsesRequest(RequestBody):
    model_config = ConfigDict(json_schema_extra={"allOf": _RULES})

    model: str | None = None
    input: NonEmpty[str] | NonEmpty[list[InputItem]]
    instructions: str | None = None  # the system message, for this response only (not carried to the next)
    max_output_tokens: Count | None = None
    temperature: bounded("temperature") | None = None
    top_p: bounded("top_p") | None = None
    tools: list[FunctionTool] | None = None
    # Default with tools: auto (which needs a server started with --enable-auto-tool-choice).
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True  # kept for GET /v1/responses/{id} and previous_response_id
    previous_response_id: str | None = None
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None
    user: str | None = None
    # auto: the conversation's earliest turns dropped, as many as the prompt needs to leave max_output_tokens (or one
    # token) of room in the model's context; disabled: a conversation too long is refused.
    truncation: Literal["disabled", "auto"] | None = None
    # Extra output: each output text's token logprobs (with top_logprobs alternatives at each position).
    include: list[Includable] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # true: the response runs on in the server (stored, so it needs store true) until GET finds it done, or POST
    # .../cancel stops it; the request is answered at once with it in progress, or, streamed, with its events, which
    # GET .../{id}?stream=true reads again (from starting_after on) whether or not the first client stayed.
    background: bool | None = None

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.include) and "message.output_text.logprobs" in self.include

    def input_items(self) -> list:
        if isinstance(self.input, str):
            return [InputMessage(role="user", content=self.input)]
        return list(self.input)

    def chat_fields(self) -> dict:
        """The fields of the chat completion request this response runs as, but for its messages."""
        fields: dict[str, Any] = {"model": self.model, "max_completion_tokens": self.max_output_tokens,
                                  "temperature": self.temperature, "top_p": self.top_p,
                                  "parallel_tool_calls": self.parallel_tool_calls, "stream": self.stream, "user": self.user}
        if self.wants_logprobs:
            fields.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        if self.tools is not None:
            fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                               for tool in self.tools]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        text_format = self.text.format if self.text is not None else None
        if isinstance(text_format, JSONSchemaTextFormat):
            schema = {"name": text_format.name, "schema": text_format.json_schema}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif isinstance(text_format, JSONObjectFormat):
            fields["response_format"] = {"type": "json_object"}
        return {name: value for name, value in fields.items() if value is not None}


def conversation_of(items: list) -> list[dict]:
    """Input items as chat messages: function calls join the assistant message before them (its text, or the calls
    before them), as a chat completion's message holds its content and its tool calls; reasoning is left out."""
    messages: list[dict] = []
    for item in items:
        if isinstance(item, ReasoningInputItem):
            continue
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


async def fitting_turns(messages: list[dict], fits: Callable[[int], Awaitable[bool]]) -> int:
    """Where the longest tail of the conversation that fits begins: the first index, at the start or at a user message
    (a turn's beginning, so that no tool answer loses its call), from which fits(index) holds, the tail shrinking as
    the index grows. Where none does, the last turn's: it is the least there is to run."""
    starts = [0] + [index for index, message in enumerate(messages) if index and message["role"] == "user"]
    low, high = 0, len(starts) - 1  # the answer lies in starts[low..high]
    while low < high:
        middle = (low + high) // 2
        if await fits(starts[middle]):
            high = middle
        else:
            low = middle + 1
    return starts[low]


# ---- what the server answers ---------------------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: random_id("msg"))
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)

    def as_input(self) -> InputMessage:
        """As a later turn's input carries it."""
        return InputMessage(role="assistant", content="".join(part.text for part in self.content))


class FunctionCallOutput(BaseModel):
    """A call the model makes (an output item; the client answers it with a function_call_output item)."""

    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: random_id("fc"))
    call_id: str
    name: str
    arguments: str = ""
    status: Literal["in_progress", "completed", "incomplete"] = "completed"

    def as_input(self) -> FunctionCallItem:
        return FunctionCallItem(type="function_call", call_id=self.call_id, name=self.name, arguments=self.arguments)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOutput(BaseModel):
    """A reasoning model's reasoning before its answer (on a server with --reasoning-parser)."""

    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: random_id("rs"))
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"

    def as_input(self) -> ReasoningInputItem:
        return ReasoningInputItem(type="reasoning", summary=[], content=[ReasoningTextPart(type="reasoning_text", text=part.text)
                                                                         for part in self.content])


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str = Field(default_factory=lambda: random_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"] = "in_progress"
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    background: bool = False
    output: list[ReasoningOutput | OutputMessage | FunctionCallOutput] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "none"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: Literal["disabled", "auto"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class InputTextItemPart(BaseModel):
    type: Literal["input_text"] = "input_text"
    text: str


class InputMessageItem(BaseModel):
    """A message of the input that was not the model's (user, system or developer), as the input items list it."""

    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: random_id("msg"))
    role: Literal["user", "system", "developer"]
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[InputTextItemPart]


class FunctionCallOutputListed(BaseModel):
    """A tool's answer to a call, as the input items list it."""

    type: Literal["function_call_output"] = "function_call_output"
    id: str = Field(default_factory=lambda: random_id("fco"))
    call_id: str
    output: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


# An item that went into a response: a message (the model's, as an output message), a call, a call's output, reasoning.
ListedItem = InputMessageItem | OutputMessage | FunctionCallOutput | FunctionCallOutputListed | ReasoningOutput


def listed_item(item) -> ListedItem:
    """A request's input item as the input items list it: with an id (its own, or a new one) and a status, and a
    message's text as content parts (a string content is one part)."""
    fields = {name: value for name, value in (("id", item.id), ("status", item.status)) if value is not None}
    if isinstance(item, FunctionCallItem):
        return FunctionCallOutput(call_id=item.call_id, name=item.name, arguments=item.arguments, **fields)
    if isinstance(item, FunctionCallOutputItem):
        return FunctionCallOutputListed(call_id=item.call_id, output=item.output, **fields)
    if isinstance(item, ReasoningInputItem):
        return ReasoningOutput(summary=[part.model_dump() for part in item.summary],
                               content=[ReasoningText(text=part.text) for part in item.content or []], **fields)
    texts = [item.content] if isinstance(item.content, str) else [part.text for part in item.content]
    if item.role == "assistant":
        return OutputMessage(content=[OutputText(text=text) for text in texts], **fields)
    return InputMessageItem(role=item.role, content=[InputTextItemPart(text=text) for text in texts], **fields)


class InputItemList(BaseModel):
    """A page of a response's input items (GET /v1/responses/{id}/input_items)."""

    object: Literal["list"] = "list"
    data: list[ListedItem]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
