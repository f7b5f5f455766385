"""Conversations to prompt text through a chat template: the model's own, or the server's (--chat-template, which
replaces it), or (only on a server that trusts request templates) one sent with the request, rendered in a separate
process under a time and memory limit. Failures of any are the request's fault: 400s naming the problem."""

from __future__ import annotations

import json
import logging
import multiprocessing
import threading

from pagedserve.entrypoints.openai.errors import APIError
from pagedserve.entrypoints.openai.protocol import ChatMessage

logger = logging.getLogger(__name__)

# apply_chat_template's own arguments, which chat_template_kwargs must not set: the server sets them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message", "return_dict",
    "return_tensors", "return_assistant_tokens_mask", "tokenizer_kwargs", "padding", "truncation", "max_length", "tools",
    "documents", "chat_template",
})
_SANDBOX_MEMORY_BYTES = 1024**3
_MAX_RENDERED_CHARS = 64 * 1024**2


class ChatTemplateRenderer:
    def __init__(self, tokenizer, trust_request_templates: bool, timeout_s: float, server_template: str | None = None) -> None:
        """server_template: the server's own template (--chat-template), used instead of the model's."""
        self.tokenizer = tokenizer
        self.server_template = server_template
        self.trust_request_templates = trust_request_templates
        self.sandbox = TemplateSandbox(timeout_s) if trust_request_templates else None

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool, request_template: str | None,
               template_kwargs: dict | None, tools: list[dict] | None = None) -> str:
        """The conversation as prompt text, the tools the model may call (OpenAI's tool objects) given to the template.
        Blocking (it may take a while): call it from a worker thread."""
        kwargs = dict(template_kwargs or {})
        template = request_template if request_template is not None else kwargs.pop("chat_template", None)
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise APIError(400, f"chat_template_kwargs must not set {', '.join(reserved)}: the server sets them",
                           param="chat_template_kwargs")
        conversation = [_template_message(m) for m in messages]
        if tools:
            kwargs["tools"] = tools
        if template is not None:
            if not self.trust_request_templates:
                raise APIError(400, "this server does not accept chat templates from requests (it must be started with "
                                    "--trust-request-chat-template)", param="chat_template")
            return self.sandbox.render(template, conversation, add_generation_prompt,
                                       {**self.tokenizer.special_tokens_map, **kwargs})
        if not (self.server_template or self.tokenizer.chat_template):
            raise APIError(400, "this model has no chat template (start the server with --chat-template, or use "
                                "/v1/completions)", param="messages")
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                      chat_template=self.server_template, **kwargs)
        except TemplateError as exc:  # the model's template refused the conversation (roles out of order, say)
            raise APIError(400, f"the chat template refused the conversation: {exc}", param="messages") from exc


def _template_message(message: ChatMessage) -> dict:
    """A message as chat templates read it: an assistant's calls with their arguments as objects, not JSON text (the
    form transformers documents for templates)."""
    entry = {"role": message.role, "content": message.text()}
    if message.name:
        entry["name"] = message.name
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        entry["tool_calls"] = [{"id": call.id, "type": call.type,
                                "function": {"name": call.function.name, "arguments": _arguments_object(call.function.arguments)}}
                               for call in message.tool_calls]
    return entry


def _arguments_object(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:  # not JSON: the template gets the text as it came
        return arguments


class TemplateSandbox:
    """Renders untrusted Jinja templates in a process of its own (jinja2's immutable sandbox, memory-capped),
    one at a time; a render over the time limit kills the process, and the next render starts a new one."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._process = None
        self._connection = None

    def render(self, template: str, conversation: list[dict], add_generation_prompt: bool, variables: dict) -> str:
        with self._lock:
            connection = self._start()
            connection.send((template, conversation, add_generation_prompt, variables))
            if not connection.poll(self.timeout_s):
                self._stop()
                raise APIError(400, f"the chat template did not render within {self.timeout_s:g} s", param="chat_template")
            try:
                ok, result = connection.recv()
            except EOFError:  # the process died: the memory cap, say
                self._stop()
                raise APIError(400, "the chat template could not be rendered (it ran out of memory)", param="chat_template") from None
        if not ok:
            raise APIError(400, f"the chat template failed: {result}", param="chat_template")
        return result

    def _start(self):
        if self._process is None or not self._process.is_alive():
            spawn = multiprocessing.get_context("spawn")
            self._connection, child = spawn.Pipe()
            self._process = spawn.Process(target=_sandbox_main, args=(child,), name="chat-template-sandbox", daemon=True)
            self._process.start()
            child.close()
        return self._connection

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join()
        self._process = None

    def close(self) -> None:
        with self._lock:
            self._stop()


def _sandbox_main(connection) -> None:
    """The sandbox process: render whatever arrives until the pipe closes."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (_SANDBOX_MEMORY_BYTES, _SANDBOX_MEMORY_BYTES))
    environment = _sandboxed_environment()
    while True:
        try:
            template, conversation, add_generation_prompt, variables = connection.recv()
        except EOFError:
            return
        try:
            text = environment.from_string(template).render(messages=conversation, add_generation_prompt=add_generation_prompt,
                                                            **variables)
            if len(text) > _MAX_RENDERED_CHARS:
                raise ValueError(f"it rendered {len(text)} characters, more than {_MAX_RENDERED_CHARS}")
            connection.send((True, text))
        except Exception as exc:  # anything the template does wrong is the request's error
            connection.send((False, f"{type(exc).__name__}: {exc}"))


def _sandboxed_environment():
    """What transformers gives chat templates: loop controls, tojson, raise_exception, strftime_now."""
    import json
    from datetime import datetime

    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = lambda value, indent=None, ensure_ascii=False: json.dumps(value, indent=indent,
                                                                                               ensure_ascii=ensure_ascii)
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment
