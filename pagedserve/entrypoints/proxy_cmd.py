"""`pagedserve proxy`: its arguments, and the proxy (entrypoints/proxy.py) started on them. Apart from the proxy so
that the CLI's parser, which every command builds, does not load the proxy's web stack."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    proxy = sub.add_parser("proxy", help="one OpenAI-compatible front door over prefill and decode instances (disaggregated "
                                         "prefill and decode with the P2pConnector)")
    proxy.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instances (http://host:port)")
    proxy.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances (http://host:port)")
    proxy.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    proxy.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    proxy.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedserve.entrypoints.proxy import build_app

    uvicorn.run(build_app(args.prefill, args.decode), host=args.host, port=args.port, log_level="warning")
    return 0
