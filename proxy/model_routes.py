"""`GET /v1/models` and `/v1/models/{id}` (runs in the proxy): one route two APIs share. A
request carrying `anthropic-version` (every Anthropic SDK sends it) gets Anthropic's model
list and model shapes, and its errors Anthropic's envelope; any other OpenAI's."""

from __future__ import annotations

from aiohttp import web

from mlxd.proxy.dialects.anthropic import routes as anthropic_routes
from mlxd.proxy.dialects.openai import routes as openai_routes
from mlxd.proxy.errors import ANTHROPIC_HEADER


async def list_models(request: web.Request) -> web.Response:
    if ANTHROPIC_HEADER in request.headers:
        return await anthropic_routes.list_models(request)
    return await openai_routes.list_models(request)


async def retrieve_model(request: web.Request) -> web.Response:
    if ANTHROPIC_HEADER in request.headers:
        return await anthropic_routes.retrieve_model(request)
    return await openai_routes.retrieve_model(request)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", retrieve_model)
