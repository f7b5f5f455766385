"""Tool calling: each parser reads its format's calls (and leaves text that is not a call as text), a stream holds back
only what may begin a call, and a server round trip with the official openai client: tool_choice auto, required and
named, two parallel calls, streamed calls reassembled equal to the non-streamed ones, and the 400s. What the model
chooses to say is held by structures in these tests (the default model is small), which hold whatever the model."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from server_utils import RemoteServer

from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest
from pagedserve.entrypoints.openai.tool_calls import ToolPlan
from pagedserve.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
                                                "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in CET?"}]


# ---- the parsers --------------------------------------------------------------------------------------------------

PARSED = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>{"name": "g", '
               '"arguments": {}}</tool_call>', "Let me look.", [("f", {"a": 1}), ("g", {})]),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": "x"}}; {"name": "g", "parameters": {"b": [1, 2]}}', None,
     [("f", {"a": "x"}), ("g", {"b": [1, 2]})]),
    ("llama3_json", ' {"name": "f", "arguments": {"a": true}}', None, [("f", {"a": True})]),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"a": null}}]', "Sure.", [("f", {"a": None})]),
    ("granite", '<|tool_call|>[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]', None,
     [("f", {"a": 1}), ("g", {})]),
    ("pythonic", '[get_weather(city="Paris", unit="C"), get_time(zone="CET")]', None,
     [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"zone": "CET"})]),
]


@pytest.mark.parametrize("parser,text,content,calls", PARSED)
def test_each_parser_reads_its_formats_calls(parser, text, content, calls):
    parsed = TOOL_CALL_PARSERS[parser]().parse(text)
    assert parsed.content == content
    assert [(call.name, json.loads(call.arguments)) for call in parsed.calls] == calls


@pytest.mark.parametrize("parser,text", [
    ("hermes", "No call here."), ("hermes", "<tool_call>{not json}</tool_call>"), ("hermes", '<tool_call>{"arguments": {}}'),
    ("llama3_json", "Hello {there}"), ("llama3_json", '{"name": "f", "parameters": {}} trailing'),
    ("mistral", "[TOOL_CALLS] not json"), ("granite", '<|tool_call|>[{"name": "f"}] and more'),
    ("pythonic", "[f(1)]"), ("pythonic", "[f(x=open('a'))]"), ("pythonic", "plain text"),
])
def test_text_that_is_not_a_call_stays_text(parser, text):
    assert TOOL_CALL_PARSERS[parser]().parse(text) is None


def plan(parser: str | None = "hermes", **fields) -> ToolPlan:
    request = ChatCompletionRequest.model_validate({"messages": ASK, "tools": TOOLS, **fields})
    return ToolPlan.of(request, parser)


def streamed(tool_plan: ToolPlan, pieces: list[str], finish_reason: str = "stop"):
    """(content sent, calls as (name, arguments), finish reason) of a text streamed in pieces."""
    stream, deltas = tool_plan.stream(), []
    for piece in pieces:
        deltas.append(stream.feed(piece))
    last, finish = stream.finish(finish_reason)
    deltas = [d for d in deltas + last if d is not None]
    content = "".join(d.content or "" for d in deltas)
    calls: dict[int, list] = {}
    for delta in deltas:
        for call in delta.tool_calls or []:
            if call.id is not None:
                assert call.index not in calls and call.type == "function" and call.function.name
                calls[call.index] = [call.function.name, ""]
            calls[call.index][1] += call.function.arguments or ""
    return content, [(name, json.loads(arguments)) for name, arguments in calls.values()], finish


def test_a_stream_sends_text_and_holds_back_only_what_may_begin_a_call():
    text = 'Checking <the> weather.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    stream = plan().stream()
    sent = [(d.content if d else None) for d in map(stream.feed, ["Checking ", "<to", "ol", "d> x"])]
    assert sent == ["Checking ", None, None, "<toold> x"]  # "<tool" waits until it is clearly not "<tool_call>"
    content, calls, finish = streamed(plan(), pieces)
    assert content == "Checking <the> weather.\n" and calls == [("get_weather", {"city": "Paris", "unit": "C"})]
    assert finish == "tool_calls"
    whole = plan().reply(text, "stop")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls] == calls
    assert streamed(plan(), ["Just text, <tool"], "stop") == ("Just text, <tool", [], "stop")  # never a call: sent as text


def test_a_named_functions_arguments_stream_as_they_come():
    named = plan(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.structure.json and json.loads(named.structure.json) == TIME["function"]["parameters"]
    content, calls, finish = streamed(named, ['{"zone"', ': "CET"}'])
    assert (content, calls, finish) == ("", [("get_time", {"zone": "CET"})], "tool_calls")


@pytest.mark.parametrize("fields,param,message", [
    ({"tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "left out"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "distinct"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
])
def test_tool_settings_that_cannot_work_are_refused_by_name(fields, param, message):
    from pagedserve.entrypoints.openai.errors import APIError

    with pytest.raises(APIError) as raised:
        plan(None, **fields)
    assert raised.value.param == param and message in raised.value.message


# ---- through the server ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(default_model_dir):
    server = RemoteServer("--max-model-len", "1024", "--kv-cache-memory", str(128 * 1024**2), "--enable-auto-tool-choice",
                          "--tool-call-parser", "hermes")
    yield server.openai()
    assert server.stop() == 0, server.log_text()[-2000:]


def assert_valid_call(call) -> None:
    tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.id.startswith("call_") and call.type == "function"


def reassembled(chunks) -> tuple[str, list[tuple[str, str]], str]:
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.id:
                    calls[call.index] = [call.function.name, ""]
                calls[call.index][1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(call) for call in calls.values()], finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_always_parse_streamed_or_not(client, tool_choice):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=120,
                                           temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls and not choice.message.content
    for call in choice.message.tool_calls:
        assert_valid_call(call)
    if isinstance(tool_choice, dict):
        assert [call.function.name for call in choice.message.tool_calls] == ["get_weather"]
    chunks = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=120,
                                            temperature=0, stream=True)
    content, calls, finish = reassembled(chunks)
    assert finish == "tool_calls" and content == ""
    assert calls == [(call.function.name, call.function.arguments) for call in choice.message.tool_calls]


def hermes_calls_regex(*calls: str) -> str:
    return "".join(re.escape(f"<tool_call>\n{call}\n</tool_call>\n") for call in calls)


def test_auto_reads_two_parallel_calls_and_the_conversation_goes_on(client):
    """The model is held to write two hermes calls (a structure beside tool_choice auto); the parser reads them, and
    the calls and their answers render back into the next turn."""
    forced = hermes_calls_regex('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}',
                                '{"name": "get_time", "arguments": {"zone": "CET"}}')
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=160, temperature=0,
                                           extra_body={"structured_outputs": {"regex": forced}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"zone": "CET"})]
    chunks = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=160, temperature=0, stream=True,
                                            extra_body={"structured_outputs": {"regex": forced}})
    assert reassembled(chunks)[1:] == ([(c.function.name, c.function.arguments) for c in choice.message.tool_calls], "tool_calls")
    follow_up = [*ASK, choice.message.model_dump(exclude_none=True),
                 *({"role": "tool", "tool_call_id": call.id, "content": "sunny" if i == 0 else "12:00"}
                   for i, call in enumerate(choice.message.tool_calls))]
    answer = client.chat.completions.create(model=MODEL, messages=follow_up, tools=TOOLS, max_tokens=8, temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_auto_without_a_call_is_text_and_none_never_calls(client):
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], tools=TOOLS,
                                           max_tokens=12, temperature=0, extra_body={"structured_outputs": {"regex": "Hello[a-z ]*"}})
    assert plain.choices[0].message.content.startswith("Hello") and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason in ("stop", "length")
    call_text = hermes_calls_regex('{"name": "get_time", "arguments": {"zone": "CET"}}')
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=40, temperature=0,
                                          extra_body={"structured_outputs": {"regex": call_text}})
    assert none.choices[0].message.content.startswith("<tool_call>") and not none.choices[0].message.tool_calls


@pytest.mark.parametrize("fields,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}], "tool_choice": "required"}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
     "guided_regex"),
])
def test_bad_tools_are_400s_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, **fields)
    assert raised.value.body["param"] == param, raised.value.body
