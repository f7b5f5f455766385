"""Tool calling in chat completions: what a request's tools and tool_choice ask of the engine, and how the text the
model writes becomes the message's tool_calls, whole or streamed as OpenAI streams them (a call's id, type and name,
then its arguments in fragments).

- "none": the tools reach the chat template; the answer is text.
- "auto" (the default with tools; the server needs --enable-auto-tool-choice --tool-call-parser NAME): the model
  writes calls in its own format (tool_parsers.py) or text; what does not parse as calls stays text.
- "required": the output is a JSON array of calls ({"name", "parameters"}), one or more (one without
  parallel_tool_calls), held to it by a structure, so it always parses.
- a named function: the output is that function's arguments, held to its parameters' schema.

On a server with a reasoning parser (reasoning.py), the calls and the text are read from the output's answer, after its
reasoning; an output held to a structure (a forced call, or the request's own response_format or structured outputs)
is the structure from its first token, so it is all answer.

Forced calls are compact JSON (no whitespace between tokens): a program reads them, and a small model given room for
whitespace tends to spend it, or to start one more call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from pagedserve.entrypoints.openai.errors import APIError
from pagedserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from pagedserve.entrypoints.openai.reasoning import ReasoningParser
from pagedserve.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS, ParsedCall, ToolCallParser
from pagedserve.sampling_params import StructuredOutputsParams

ANY_OBJECT = {"type": "object"}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall(id=new_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))


@dataclass
class ToolReply:
    """What a choice's finished text is: its content, its calls, and its finish reason (and its reasoning)."""

    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None
    reasoning: str | None = None


class ToolPlan:
    """A request's tool calling, checked: mode is none, auto, required or named; and, where the output has reasoning
    to set apart first, its reasoning parser."""

    def __init__(self, mode: str, parser: ToolCallParser | None = None, function_name: str | None = None,
                 structure: StructuredOutputsParams | None = None, parallel: bool = True) -> None:
        self.mode = mode
        self.parser = parser
        self.function_name = function_name
        self.structure = structure  # what the engine holds the output to, for required and named
        self.parallel = parallel
        self.reasoning: ReasoningParser | None = None

    @classmethod
    def of(cls, request: ChatCompletionRequest, parser_name: str | None, reasoning: ReasoningParser | None = None) -> ToolPlan:
        """parser_name: the server's --tool-call-parser when it runs with --enable-auto-tool-choice, else None;
        reasoning: its --reasoning-parser's (the engine holds a structure to the answer after the reasoning, so a
        structured output has its reasoning too). Raises APIError (400) naming the field at fault."""
        plan = cls._checked(request, parser_name)
        plan.reasoning = reasoning
        return plan

    @classmethod
    def _checked(cls, request: ChatCompletionRequest, parser_name: str | None) -> ToolPlan:
        tools = request.tools or []
        choice = request.tool_choice
        if not tools:
            if choice not in (None, "none"):
                raise APIError(400, "tool_choice needs tools: give the functions the model may call", param="tool_choice")
            return cls("none")
        names = [tool.function.name for tool in tools]
        if len(set(names)) < len(names):
            raise APIError(400, "tools must have distinct function names", param="tools")
        choice = "auto" if choice is None else choice
        structure_field = _structure_field(request)
        if choice != "none" and choice != "auto" and structure_field is not None:
            raise APIError(400, f"{structure_field} must be left out: tool_choice {_describe(choice)} gives the output's "
                                "structure", param=structure_field)
        if choice == "none":
            return cls("none")
        if choice == "auto":
            if parser_name is None:
                raise APIError(400, 'tool_choice "auto" needs a server started with --enable-auto-tool-choice and --tool-call-parser',
                               param="tool_choice")
            return cls("auto", parser=TOOL_CALL_PARSERS[parser_name](), parallel=request.parallel_tool_calls)
        if choice == "required":
            return cls("required", structure=_compact(_calls_schema(tools, request.parallel_tool_calls)),
                       parallel=request.parallel_tool_calls)
        name = choice.function.name
        tool = next((tool for tool in tools if tool.function.name == name), None)
        if tool is None:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not among tools", param="tool_choice")
        return cls("named", function_name=name, structure=_compact(tool.function.parameters or ANY_OBJECT))

    def reply(self, text: str, finish_reason: str | None) -> ToolReply:
        """A choice's finished text as its message."""
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(text)
            if text is None:  # cut off while reasoning: no answer
                return ToolReply(None, [], finish_reason, reasoning)
        calls = self.calls_in(text)
        if calls is None:
            return ToolReply(text, [], finish_reason, reasoning)
        content, parsed = calls
        return ToolReply(content, [tool_call(call) for call in parsed], _finish_with_calls(finish_reason), reasoning)

    def calls_in(self, text: str) -> tuple[str | None, list[ParsedCall]] | None:
        if self.mode == "named":
            return None, [ParsedCall(self.function_name, text)]
        if self.mode == "required":
            calls = _parse_required(text)
            return (None, calls) if calls else None
        if self.mode == "auto":
            parsed = self.parser.parse(text)
            if parsed is None:
                return None
            return parsed.content, parsed.calls if self.parallel else parsed.calls[:1]
        return None

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


class ToolCallStream:
    """One choice's stream: its text deltas in, the deltas to send out. Text that may turn out to be a call is held
    back; a named function's arguments stream as they come; other calls go out whole once the text is finished. With a
    reasoning parser, the reasoning goes out as it comes, and what follows it is the text read for calls."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""  # the answer's text so far
        self.sent = 0  # characters of text already sent as content
        self.in_call = False
        self.call_id = new_call_id()
        self.reasoning = plan.reasoning.stream() if plan.reasoning is not None else None

    def feed(self, delta: str) -> DeltaMessage | None:
        if self.reasoning is None:
            return self._feed_answer(delta)
        reasoning, answer = self.reasoning.feed(delta)
        return _with_reasoning(self._feed_answer(answer), reasoning)

    def _feed_answer(self, delta: str) -> DeltaMessage | None:
        if not delta:
            return None
        first = not self.text
        self.text += delta
        mode = self.plan.mode
        if mode == "none":
            return DeltaMessage(content=delta)
        if mode == "named":
            return DeltaMessage(tool_calls=[_call_delta(0, self.call_id, self.plan.function_name, delta) if first
                                            else DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta))])
        if mode == "required" or self.in_call:
            return None
        start = self.plan.parser.call_start(self.text)
        if start is not None:
            self.in_call = True
            return self._content_up_to(start)
        return self._content_up_to(len(self.text) - self.plan.parser.undecided_tail(self.text))

    def finish(self, finish_reason: str | None) -> tuple[list[DeltaMessage], str | None]:
        """The deltas still to send once the choice's text is finished, and its finish reason."""
        held = []
        if self.reasoning is not None:  # what it held back, as the text it turned out to be
            reasoning, answer = self.reasoning.finish()
            held = [delta for delta in (_with_reasoning(self._feed_answer(answer), reasoning),) if delta is not None]
            if not self.reasoning.reached_answer:  # cut off while reasoning: no answer to read calls from
                return held, finish_reason
        deltas, finish_reason = self._finish_answer(finish_reason)
        return held + deltas, finish_reason

    def _finish_answer(self, finish_reason: str | None) -> tuple[list[DeltaMessage], str | None]:
        mode = self.plan.mode
        if mode == "none":
            return [], finish_reason
        if mode == "named":
            return [], _finish_with_calls(finish_reason)
        calls = self.plan.calls_in(self.text)
        if calls is None:
            rest = self._content_up_to(len(self.text))
            return ([rest] if rest else []), finish_reason
        deltas = []
        for index, call in enumerate(calls[1]):
            deltas.append(DeltaMessage(tool_calls=[_call_delta(index, new_call_id(), call.name, "")]))
            deltas.append(DeltaMessage(tool_calls=[DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=call.arguments))]))
        return deltas, _finish_with_calls(finish_reason)

    def _content_up_to(self, end: int) -> DeltaMessage | None:
        if end <= self.sent:
            return None
        content, self.sent = self.text[self.sent:end], end
        return DeltaMessage(content=content)


def _structure_field(request: ChatCompletionRequest) -> str | None:
    """The request's field that gives the output's structure; two that give it are a 400 naming the second."""
    try:
        return request.structure_field()
    except ValueError as exc:
        raise APIError.bad_request(exc) from exc


def _with_reasoning(delta: DeltaMessage | None, reasoning: str) -> DeltaMessage | None:
    """The answer's delta with the reasoning that came beside it, if any."""
    if not reasoning:
        return delta
    if delta is None:
        return DeltaMessage(reasoning=reasoning)
    delta.reasoning = reasoning
    return delta


def _call_delta(index: int, call_id: str, name: str, arguments: str) -> DeltaToolCall:
    return DeltaToolCall(index=index, id=call_id, type="function", function=DeltaFunctionCall(name=name, arguments=arguments))


def _finish_with_calls(finish_reason: str | None) -> str | None:
    """A choice that ends in calls finishes with "tool_calls", unless max_tokens cut it."""
    return finish_reason if finish_reason == "length" else "tool_calls"


def _compact(schema: dict) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def _calls_schema(tools, parallel: bool) -> dict:
    """tool_choice "required": a JSON array of calls, each one of the tools with arguments to its parameters."""
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                               "parameters": tool.function.parameters or ANY_OBJECT},
              "required": ["name", "parameters"]} for tool in tools]
    return {"type": "array", "items": {"anyOf": calls}, "minItems": 1, **({} if parallel else {"maxItems": 1})}


def _parse_required(text: str) -> list[ParsedCall] | None:
    try:
        items = json.loads(text)
    except ValueError:  # cut by max_tokens
        return None
    if not isinstance(items, list):
        return None
    calls = [ParsedCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False))
             for item in items if isinstance(item, dict) and isinstance(item.get("name"), str)]
    return calls or None


def _describe(choice) -> str:
    return f'"{choice}"' if isinstance(choice, str) else f"naming {choice.function.name!r}"
