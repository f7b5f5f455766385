"""Tool calls in what a model wrote (tool_choice "auto", `--tool-call-parser NAME`): one parser per format in wide use.
A parser says where a call begins in the text (so a stream holds back what may be one) and reads the calls out of the
finished text; text that does not parse as calls stays text.

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call, after any text (Hermes,
  Qwen 2.5 and 3).
- llama3_json: a JSON object `{"name": ..., "parameters": {...}}` (or "arguments"), several separated by ";",
  optionally after `<|python_tag|>` (Llama 3.1 and 3.2).
- mistral: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}` (Mistral v0.3).
- granite: `<|tool_call|>` then such an array (IBM Granite 3).
- pythonic: a Python list of calls, `[get_weather(city="Paris"), f()]` (Llama 3.2 and 4).
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass


@dataclass
class ParsedCall:
    name: str
    arguments: str  # a JSON object's text


@dataclass
class ParsedText:
    content: str | None  # the text beside the calls, if any
    calls: list[ParsedCall]


class ToolCallParser:
    name = ""

    def call_start(self, text: str) -> int | None:
        """Where a call begins in text, once that is certain; None while none has (or it cannot be told yet)."""
        raise NotImplementedError

    def undecided_tail(self, text: str) -> int:
        """How many characters at the end of text may yet turn out to begin a call: a stream holds them back."""
        raise NotImplementedError

    def parse(self, text: str) -> ParsedText | None:
        """The calls in a finished text; None when it holds none that parse (it is then text)."""
        raise NotImplementedError


def _arguments_text(arguments) -> str | None:
    """A call's arguments as JSON text: an object, or its text."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return json.dumps(arguments, ensure_ascii=False) if isinstance(arguments, dict) else None


def _call_of(item, arguments_keys: tuple[str, ...]) -> ParsedCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    key = next((k for k in arguments_keys if k in item), None)
    arguments = _arguments_text(item[key]) if key else "{}"
    return ParsedCall(item["name"], arguments) if arguments is not None else None


def _calls_of(items: list, arguments_keys: tuple[str, ...]) -> list[ParsedCall] | None:
    calls = [_call_of(item, arguments_keys) for item in items]
    return calls if calls and all(calls) else None


class _MarkedParser(ToolCallParser):
    """Calls that follow a marker, with any text before it."""

    marker = ""

    def call_start(self, text: str) -> int | None:
        index = text.find(self.marker)
        return index if index >= 0 else None

    def undecided_tail(self, text: str) -> int:
        for length in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if self.marker.startswith(text[-length:]):
                return length
        return 0

    def _content(self, text: str) -> str | None:
        return text[: text.find(self.marker)].strip() or None


class HermesParser(_MarkedParser):
    name = "hermes"
    marker = "<tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedText | None:
        items = []
        for block in self._block.findall(text):
            try:
                items.append(json.loads(block))
            except ValueError:
                return None
        calls = _calls_of(items, ("arguments", "parameters"))
        return ParsedText(self._content(text), calls) if calls else None


class _MarkedListParser(_MarkedParser):
    """A JSON array of calls after a marker, and nothing after it."""

    def parse(self, text: str) -> ParsedText | None:
        start = self.call_start(text)
        if start is None:
            return None
        try:
            items, end = json.JSONDecoder().raw_decode(text, start + len(self.marker) + _leading_spaces(text[start + len(self.marker):]))
        except ValueError:
            return None
        if text[end:].strip() or not isinstance(items, list):
            return None
        calls = _calls_of(items, ("arguments", "parameters"))
        return ParsedText(self._content(text), calls) if calls else None


class MistralParser(_MarkedListParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"


class GraniteParser(_MarkedListParser):
    name = "granite"
    marker = "<|tool_call|>"


class _WholeTextParser(ToolCallParser):
    """Calls that are the whole text, told by how it begins after any whitespace (and a tag)."""

    openings: tuple[str, ...] = ()

    def call_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if any(stripped.startswith(opening) for opening in self.openings):
            return 0
        return None

    def undecided_tail(self, text: str) -> int:
        stripped = text.lstrip()
        if any(opening.startswith(stripped) for opening in self.openings):  # whitespace, or the start of an opening
            return len(text)
        return 0


class Llama3JsonParser(_WholeTextParser):
    name = "llama3_json"
    tag = "<|python_tag|>"
    openings = (tag, "{")

    def parse(self, text: str) -> ParsedText | None:
        body = text.strip().removeprefix(self.tag)
        decoder, items, position = json.JSONDecoder(), [], 0
        while True:
            position += _leading_spaces(body[position:])
            if position >= len(body):
                break
            try:
                item, position = decoder.raw_decode(body, position)
            except ValueError:
                return None
            items.append(item)
            position += _leading_spaces(body[position:])
            if body[position:position + 1] == ";":
                position += 1
        calls = _calls_of(items, ("parameters", "arguments"))
        return ParsedText(None, calls) if calls else None


class PythonicParser(_WholeTextParser):
    name = "pythonic"
    openings = ("[",)

    def parse(self, text: str) -> ParsedText | None:
        try:
            tree = ast.parse(text.strip(), mode="eval").body
        except (SyntaxError, ValueError, RecursionError):  # not Python, a NUL, or nested too deep
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            try:
                arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
            except (ValueError, TypeError, SyntaxError, RecursionError):  # not a literal
                return None
            if None in arguments:  # **kwargs
                return None
            try:
                calls.append(ParsedCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
            except (TypeError, ValueError):  # a literal JSON has no form for (a set, bytes)
                return None
        return ParsedText(None, calls)


def _leading_spaces(text: str) -> int:
    return len(text) - len(text.lstrip())


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser, MistralParser, GraniteParser, PythonicParser)}
