"""The `pagedserve` command: serve | generate | chat | bench | proxy | export."""

from __future__ import annotations

import argparse
import sys

from pagedserve import log

# OpenMP's wait policy and spin count are set by the package's __init__, which runs before this module.


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    log.configure()
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    from pagedserve.entrypoints import bench_cmd, export_cmd, generate_cmd, proxy_cmd, serve_cmd

    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM inference and serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_cmd.register(sub)
    generate_cmd.register(sub)
    bench_cmd.register(sub)
    proxy_cmd.register(sub)
    export_cmd.register(sub)
    return parser


if __name__ == "__main__":
    sys.exit(main())
