"""The web console at /: a chat page over the server's own API, and a live view of the engine fed by a stream of
engine stats (server-sent events). On a server with runner pooling (an embedding or a classification model), which
serves no chat, the page shows the engine view alone and names what the server gives instead. The page is static and
ships in this package (no build step, nothing fetched): index.html, console.js, console.css. Its responses carry a
content security policy that runs only these scripts, so nothing the model writes can run as code in the page (which,
in any case, renders the model's text as text)."""

from __future__ import annotations

import asyncio
import json
from importlib import resources

from fastapi import FastAPI, Query, Request
from fastapi.responses import Response, StreamingResponse

from pagedserve.engine.async_llm import AsyncLLM

# The page's own files: open without the API key (the page asks for the key, then sends it with every call).
_ASSETS = {"/": ("index.html", "text/html; charset=utf-8"), "/console/console.js": ("console.js", "text/javascript; charset=utf-8"),
           "/console/console.css": ("console.css", "text/css; charset=utf-8"), "/console/icon.svg": ("icon.svg", "image/svg+xml")}
PAGE_ROUTES = tuple(_ASSETS)
STATS_ROUTE = "/console/stats"
SERVER_ROUTE = "/console/server"
# Scripts and styles from this server only (no inline script, no eval), calls to this server only, no frames.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
                           "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "no-referrer"}
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.1, 10.0


def install_web_console(app: FastAPI, engine: AsyncLLM, default_interval_s: float) -> None:
    files = resources.files(__package__)
    for route, (name, media_type) in _ASSETS.items():
        _add_asset(app, route, files.joinpath(name).read_bytes(), media_type)

    # Not in the OpenAPI schema: the page's own calls (docs/web_console.md describes them), and a stream without end.
    @app.get(SERVER_ROUTE, include_in_schema=False)
    async def server_facts():
        """What the page adapts to: the runner (generate: text, so the chat page; pooling: no chat) and what the model
        gives (pagedserve/tasks.py)."""
        facts = {"runner": engine.config.runner, "tasks": list(engine.front_end.tasks)}
        return Response(json.dumps(facts), media_type="application/json", headers=SECURITY_HEADERS)

    @app.get(STATS_ROUTE, include_in_schema=False)
    async def engine_stats(request: Request, interval: float = Query(default_interval_s, ge=MIN_INTERVAL_S, le=MAX_INTERVAL_S)):
        return StreamingResponse(_stats_events(engine, request, interval), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **SECURITY_HEADERS})


def _add_asset(app: FastAPI, route: str, body: bytes, media_type: str) -> None:
    async def asset():
        return Response(body, media_type=media_type, headers={"Cache-Control": "no-cache", **SECURITY_HEADERS})

    app.add_api_route(route, asset, methods=["GET"], include_in_schema=False)


async def _stats_events(engine: AsyncLLM, request: Request, interval_s: float):
    """A sample now, then one every interval_s seconds, until the viewer goes away."""
    view = engine.engine_view
    cursor = view.new_cursor()
    while True:
        yield f"data: {json.dumps(view.sample(cursor), separators=(',', ':'))}\n\n"
        await asyncio.sleep(interval_s)
        if await request.is_disconnected():
            return
