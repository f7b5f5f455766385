"""`pagedserve serve`: the OpenAI-compatible server."""

from __future__ import annotations

from pagedserve.entrypoints.engine_args import add_engine_args, engine_config_from_args


def register(sub) -> None:
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    group = serve.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    group.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    group.add_argument("--served-model-name", nargs="+", default=None,
                       help="model name(s) clients use (default: the --model value)")
    group.add_argument("--max-waiting-requests", type=int, default=None,
                       help="answer 503 when this many requests already wait for the engine (default: no limit)")
    group.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn log level; the access log is at info")
    add_engine_args(serve)
    serve.set_defaults(handler=run_serve)


def run_serve(args) -> int:
    from pagedserve.entrypoints.openai.launch import run_server
    from pagedserve.entrypoints.openai.settings import ServerSettings

    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        raise ValueError(f"max_waiting_requests must be >= 0, got {args.max_waiting_requests}")
    settings = ServerSettings(host=args.host, port=args.port, api_key=args.api_key, served_model_name=args.served_model_name or [],
                              max_waiting_requests=args.max_waiting_requests, log_level=args.log_level)
    return run_server(engine_config_from_args(args), settings)
