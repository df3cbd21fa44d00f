"""The proxy's intake (`proxy/core/intake.py`): a request leaves it as it is sent to an
engine, and is sent `alone` only when no other request is being read or checked; the count
goes back to zero however requests end. A real aiohttp server, handlers that wait on events."""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from mlxd.proxy.core import intake


def test_a_request_leaves_the_intake_alone_only_when_no_other_is_in_it():
    async def run() -> None:
        left: dict[str, bool] = {}
        gates = {"a": asyncio.Event(), "b": asyncio.Event()}
        reading = {"a": asyncio.Event(), "b": asyncio.Event()}

        async def handler(request: web.Request) -> web.Response:
            name = request.match_info["name"]
            reading[name].set()
            await gates[name].wait()  # its body read and checked
            if request.query.get("send"):
                left[name] = intake.leave()
            return web.Response(text=name)

        async def failing(request: web.Request) -> web.Response:
            raise web.HTTPBadRequest()  # a request refused before it reaches an engine

        app = web.Application(middlewares=[intake.middleware])
        app.router.add_get("/{name}", handler)
        app.router.add_get("/bad/x", failing)
        async with TestClient(TestServer(app)) as client:
            assert intake.in_intake() == 0
            a = asyncio.ensure_future(client.get("/a?send=1"))
            b = asyncio.ensure_future(client.get("/b?send=1"))
            await reading["a"].wait()
            await reading["b"].wait()
            assert intake.in_intake() == 2
            gates["a"].set()
            assert (await a).status == 200
            assert left == {"a": False}  # b was still being read
            assert intake.in_intake() == 1
            gates["b"].set()
            assert (await b).status == 200
            assert left == {"a": False, "b": True}  # it left the intake empty
            assert (await client.get("/bad/x")).status == 400
            assert intake.in_intake() == 0
            gates["a"].clear()
            reading["a"].clear()
            c = asyncio.ensure_future(client.get("/a"))  # answered without being sent
            await reading["a"].wait()
            gates["a"].set()
            assert (await c).status == 200 and intake.in_intake() == 0

    asyncio.run(run())
