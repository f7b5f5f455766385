"""`pagedserve serve`: the OpenAI-compatible server."""

from __future__ import annotations

import argparse
from pathlib import Path

from pagedserve.entrypoints.engine_args import add_engine_args, engine_config_from_args
from pagedserve.entrypoints.openai.settings import DEFAULT_MAX_TOKENS, LoRAModule
from pagedserve.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS


def register(sub) -> None:
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    group = serve.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    group.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but /health (and /metrics, unless "
                            "--metrics-require-api-key)")
    group.add_argument("--metrics-require-api-key", action=argparse.BooleanOptionalAction, default=False,
                       help="with --api-key, protect /metrics too")
    group.add_argument("--served-model-name", nargs="+", default=None,
                       help="model name(s) clients use (default: the --model value)")
    group.add_argument("--max-waiting-requests", type=int, default=None,
                       help="answer 503 when this many samples already wait for the engine (default: no limit)")
    group.add_argument("--max-n", type=int, default=None,
                       help="most samples (n) one request may ask for (default: 128, and never more than --max-num-seqs "
                            "or --max-waiting-requests)")
    group.add_argument("--max-request-bytes", type=int, default=16 * 1024**2,
                       help="largest request body accepted; 413 beyond it (default: %(default)s)")
    group.add_argument("--chat-template", default=None, type=_chat_template,
                       help="the chat template to use instead of the model's: a file's path, or the template itself "
                            "(text with a brace or a line break) (default: the model's)")
    group.add_argument("--trust-request-chat-template", action=argparse.BooleanOptionalAction, default=False,
                       help="accept a chat template sent with the request (chat_template); it renders in a separate, "
                            "time-limited process")
    group.add_argument("--chat-template-timeout", type=float, default=5.0,
                       help="seconds a request's own chat template may take to render (default: %(default)s)")
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGTERM, seconds in-flight requests get to finish before they are ended with an error "
                            "(default: %(default)s)")
    group.add_argument("--default-max-tokens", type=_tokens_or_none, default=DEFAULT_MAX_TOKENS,
                       help="tokens a request that gives no max_tokens may generate, unless the model's generation_config "
                            "sets max_new_tokens; 'none': up to the context (default: %(default)s)")
    group.add_argument("--request-read-timeout", type=float, default=30.0,
                       help="seconds a client may take to send a request's line and headers, and again its body; 408 "
                            "and the connection closed beyond (default: %(default)s)")
    group.add_argument("--keep-alive-timeout", type=float, default=5.0,
                       help="seconds an idle connection is kept open between requests (default: %(default)s)")
    group.add_argument("--max-connections", type=int, default=4096,
                       help="open client connections at most; one beyond gets 503 and is closed (default: %(default)s)")
    group.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=False,
                       help='tool_choice "auto" (the default when a chat request gives tools): the model\'s tool calls are read '
                            "from its text in the --tool-call-parser format (default: off, such requests are refused)")
    group.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_CALL_PARSERS),
                       help="the format the model writes tool calls in, for tool_choice auto: hermes (<tool_call> JSON), "
                            "llama3_json, mistral ([TOOL_CALLS] JSON), granite (<|tool_call|> JSON) or pythonic ([f(x=1)])")
    group.add_argument("--web-console", action=argparse.BooleanOptionalAction, default=True,
                       help="serve the web console at /: a chat page and a live view of the engine (--no-web-console: off)")
    group.add_argument("--web-console-show-prompts", action=argparse.BooleanOptionalAction, default=False,
                       help="let the web console's engine view show the text of the prompts being prefilled (default: "
                            "request ids only)")
    group.add_argument("--lora-modules", nargs="+", default=[], type=_lora_module, metavar="NAME=PATH",
                       help="LoRA adapters (PEFT directories) to serve, each under the name requests give as their model "
                            "(also vLLM's JSON form '{\"name\": ..., \"path\": ...}'); needs --enable-lora")
    group.add_argument("--allow-runtime-lora-updating", action=argparse.BooleanOptionalAction, default=False,
                       help="let /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key) change the adapters "
                            "while the server runs")
    group.add_argument("--max-stored-responses", type=int, default=1000,
                       help="responses (/v1/responses with store true, the API's default) kept in memory for "
                            "previous_response_id and GET /v1/responses/ID, the oldest dropped beyond; 0: none kept, and a "
                            "request's store true is refused (default: %(default)s)")
    group.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn log level; the access log is at info (default: %(default)s)")
    add_engine_args(serve)
    serve.set_defaults(handler=run_serve)


def _lora_module(text: str) -> LoRAModule:
    try:
        return LoRAModule.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _chat_template(value: str) -> str:
    """--chat-template's template: the text itself where it has a brace or a line break (as vLLM reads the option),
    else the file it names; checked to parse, so that a bad one stops the start rather than every chat request."""
    text = value
    if not any(mark in value for mark in "{}\n"):
        try:
            text = Path(value).read_text()
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"{value!r} is neither a template nor a file that can be read ({exc.strerror})") from None
    import jinja2

    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise argparse.ArgumentTypeError(f"the template does not parse: {exc} (line {exc.lineno})") from None
    return text


def _tokens_or_none(text: str) -> int | None:
    if text.lower() == "none":
        return None
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 or 'none', got {value}")
    return value


def run_serve(args) -> int:
    from pagedserve.entrypoints.openai.launch import run_server
    from pagedserve.entrypoints.openai.settings import ServerSettings

    for name in ("max_waiting_requests", "max_stored_responses", "max_n", "max_request_bytes", "max_connections"):
        value = getattr(args, name)
        least = 0 if name in ("max_waiting_requests", "max_stored_responses") else 1
        if value is not None and value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    for name in ("chat_template_timeout", "shutdown_timeout", "request_read_timeout", "keep_alive_timeout"):
        if getattr(args, name) <= 0:
            raise ValueError(f"{name} must be > 0 seconds, got {getattr(args, name)}")
    settings = ServerSettings(
        host=args.host, port=args.port, api_key=args.api_key, served_model_name=args.served_model_name or [],
        max_waiting_requests=args.max_waiting_requests, log_level=args.log_level, max_n=args.max_n,
        max_request_bytes=args.max_request_bytes, metrics_require_api_key=args.metrics_require_api_key,
        trust_request_chat_template=args.trust_request_chat_template, chat_template_timeout=args.chat_template_timeout,
        chat_template=args.chat_template,
        shutdown_timeout=args.shutdown_timeout, default_max_tokens=args.default_max_tokens,
        request_read_timeout=args.request_read_timeout, keep_alive_timeout=args.keep_alive_timeout,
        max_connections=args.max_connections, enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser, web_console=args.web_console,
        web_console_show_prompts=args.web_console_show_prompts, lora_modules=args.lora_modules,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating, max_stored_responses=args.max_stored_responses,
    )
    return run_server(engine_config_from_args(args), settings)
