"""The routes the proxy serves, read from its aiohttp router: the app is built as the proxy
builds it (proxy/app.py's make_app), with an engine client that never connects. Tests that
must cover every route (fuzzing, deep JSON, the README's endpoint table) compare against this,
so a new route is noticed by construction."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

Route = tuple[str, str]  # (method, path template with every placeholder written `{}`)

_PLACEHOLDER = re.compile(r"\{[^}]*\}")


def template(path: str) -> str:
    """`/v1/models/{model:.+}` and `/v1/models/{id}` both as `/v1/models/{}`."""
    return _PLACEHOLDER.sub("{}", path)


@cache
def served_routes() -> frozenset[Route]:
    import zmq.asyncio

    from mlxd.protocol.addresses import Endpoints
    from mlxd.proxy.app import ListenSettings, make_app
    from mlxd.proxy.core.sampling import Defaults
    from mlxd.proxy.engines.client import EngineClient
    from mlxd.proxy.engines.router import Router

    ctx = zmq.asyncio.Context()
    try:
        client = EngineClient(ctx, Endpoints.inproc("routes", Path("/nonexistent")), {})
        router = Router(client, load_wait=1, aliases={}, pool=None, send=None, batch=1)
        app = make_app(client, router, Defaults(0, 1, 0, 1), ListenSettings())
        return frozenset((r.method, template(r.resource.canonical))
                         for r in app.router.routes() if r.resource is not None)
    finally:
        ctx.term()
