"""Anthropic Messages API (runs in the proxy): `POST /v1/messages` (streaming with Anthropic's
event sequence, or not) and `POST /v1/messages/count_tokens`. Errors use Anthropic's envelope
(errors.py picks it from the path)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime

from aiohttp import web

from mlxd.protocol.messages import Delta
from mlxd.proxy.bounds import decode_body
from mlxd.proxy.core import constraints
from mlxd.proxy.core.generation import Generation, GenerationRequest, started_generation
from mlxd.proxy.core.keepalive import with_pings
from mlxd.proxy.core.model_list import find_model, served_models
from mlxd.proxy.core.sampling import count_only
from mlxd.proxy.dialects.anthropic import schema
from mlxd.proxy.errors import APIError, bad_request
from mlxd.proxy.state import STATE

PING_EVERY = 10  # content deltas between `ping` events
_END = Delta("")  # the end of a stream's deltas (None from `with_pings` is a keep-alive)


def _event(name: str, data: dict) -> bytes:
    return (f"event: {name}\ndata: ".encode() + json.dumps(data, ensure_ascii=False).encode()
            + b"\n\n")


async def messages(request: web.Request) -> web.StreamResponse:
    req = decode_body(await request.read(), schema.MessagesRequest)
    schema.check_fields(req)
    msgs = schema.chat_messages(req)
    tools, forced, offered = schema.tools_and_choice(req)
    checked = schema.sampling(req, request.app[STATE].defaults)
    fmt = schema.output_format(req)
    if fmt is not None and forced:
        raise bad_request("output_config.format and a forced tool_choice exclude each other")
    grammar = constraints.call_grammar(forced) if forced else \
        constraints.schema_grammar(fmt, "output_config.format.schema") if fmt else None
    job = GenerationRequest(
        model=req.model, sampling=checked, id_prefix="msg", messages=msgs,
        tools=[t.as_template_tool() for t in tools] if offered else None, grammar=grammar,
        images=schema.chat_images(req))
    async with started_generation(request.app[STATE], job) as gen:
        msg_id = "msg_" + uuid.uuid4().hex[:24]
        if req.stream:
            return await _stream(request, gen, msg_id, forced)
        got = await gen.collect()
        content: list[dict] = [{"type": "thinking", "thinking": got.reasoning,
                                "signature": ""}] if got.reasoning else []
        if forced:
            content = [_forced_block(got.text, forced)]
        else:
            if got.text or not got.tool_calls:
                content.append({"type": "text", "text": got.text})
            content += [_tool_use_block(c) for c in got.tool_calls]
        return web.json_response({
            "id": msg_id, "type": "message", "role": "assistant", "model": gen.model_name,
            "content": content,
            "stop_reason": _stop_reason(got.finish_reason, got.stop_sequence,
                                        bool(forced or got.tool_calls)),
            "stop_sequence": got.stop_sequence, "usage": _usage(gen)})


def _stop_reason(finish: str | None, stop_sequence: str | None, called: bool) -> str:
    return "tool_use" if called and finish == "stop" else \
        schema.stop_reason(finish, stop_sequence)


def _usage(gen: Generation, output_tokens: int | None = None) -> dict:
    return schema.usage(gen.prompt_tokens, gen.cached_tokens,
                        gen.completion_tokens if output_tokens is None else output_tokens)


async def _stream(request: web.Request, gen: Generation, msg_id: str,
                  forced: list[constraints.Tool] | None) -> web.StreamResponse:
    """Anthropic's event sequence. `message_start` waits for the first token, so its usage
    says how much of the prompt the KV cache served (and an error before it is a status)."""
    deltas = with_pings(gen.deltas(), request.app[STATE].stream_ping)
    got = await anext(deltas, _END)  # an error this soon is still a status
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    try:
        while got is None:  # no token yet (a long prefill): `ping`s until it comes
            await resp.write(_event("ping", {"type": "ping"}))
            got = await anext(deltas, _END)
    except APIError as e:
        await resp.write(_event("error", e.body("anthropic")))
        await resp.write_eof()
        return resp
    first = None if got is _END else got
    await resp.write(_event("message_start", {"type": "message_start", "message": {
        "id": msg_id, "type": "message", "role": "assistant", "model": gen.model_name,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": _usage(gen, output_tokens=0)}}) + _event("ping", {"type": "ping"}))
    out: list[bytes] = []
    blocks = _Blocks(out)
    sent = calls = 0
    held = ""  # a forced call's text, sent as one tool_use block once complete
    try:
        d = first
        while d is not None:
            if d.reasoning:
                blocks.open("thinking")
                out.append(_event("content_block_delta", {
                    "type": "content_block_delta", "index": blocks.index,
                    "delta": {"type": "thinking_delta", "thinking": d.reasoning}}))
            if forced:
                held += d.text
            elif d.text:
                blocks.open("text")
                out.append(_event("content_block_delta", {
                    "type": "content_block_delta", "index": blocks.index,
                    "delta": {"type": "text_delta", "text": d.text}}))
                sent += 1
                if sent % PING_EVERY == 0:
                    out.append(_event("ping", {"type": "ping"}))
            called = [_forced_block(held, forced)] \
                if forced and d.finish_reason is not None else \
                [_tool_use_block(c) for c in d.tool_calls or ()]
            for block in called:
                blocks.open("tool_use", {**block, "input": {}})
                out.append(_event("content_block_delta", {
                    "type": "content_block_delta", "index": blocks.index,
                    "delta": {"type": "input_json_delta",
                              "partial_json": json.dumps(block["input"], ensure_ascii=False)}}))
                calls += 1
            if d.finish_reason is not None:
                if "text" not in blocks.seen and not calls:
                    blocks.open("text")  # an answer has its text block, even if empty
                blocks.close()
                out.append(_event("message_delta", {
                    "type": "message_delta",
                    "delta": {"stop_reason": _stop_reason(d.finish_reason, d.stop_sequence,
                                                          bool(calls)),
                              "stop_sequence": d.stop_sequence},
                    "usage": _usage(gen)}))
                out.append(_event("message_stop", {"type": "message_stop"}))
            if not gen.pending():
                await resp.write(b"".join(out))
                out.clear()
            got = await anext(deltas, _END)
            while got is None:  # a long pause (a resumed request prefilling again)
                await resp.write(b"".join(out) + _event("ping", {"type": "ping"}))
                out.clear()
                got = await anext(deltas, _END)
            d = None if got is _END else got
        if out:
            await resp.write(b"".join(out))
    except APIError as e:  # after the stream started: Anthropic's `error` event
        await resp.write(b"".join(out) + _event("error", e.body("anthropic")))
    await resp.write_eof()
    return resp


def _forced_block(text: str, tools: list[constraints.Tool]) -> dict:
    """A forced call's output as a tool_use block (a length limit may have cut it: it is
    still the call, with the input written so far)."""
    name, args = constraints.forced_call(text, tools)
    return {"type": "tool_use", "id": constraints.new_call_id("toolu_"), "name": name,
            "input": args}


def _tool_use_block(call: dict) -> dict:
    try:
        args = json.loads(call["arguments"])
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": constraints.new_call_id("toolu_"), "name": call["name"],
            "input": args if isinstance(args, dict) else {}}


class _Blocks:
    """Content blocks opened as their first delta arrives: thinking (if any), then text."""

    def __init__(self, out: list[bytes]) -> None:
        self.out = out
        self.kind: str | None = None
        self.index = -1
        self.seen: set[str] = set()

    def open(self, kind: str, block: dict | None = None) -> None:
        if self.kind == kind and kind != "tool_use":  # each call is a block of its own
            return
        self.close()
        self.kind, self.index = kind, self.index + 1
        self.seen.add(kind)
        if block is None:
            block = {"type": "text", "text": ""} if kind == "text" else \
                {"type": "thinking", "thinking": "", "signature": ""}
        self.out.append(_event("content_block_start", {
            "type": "content_block_start", "index": self.index, "content_block": block}))

    def close(self) -> None:
        if self.kind is not None:
            if self.kind == "thinking":
                self.out.append(_event("content_block_delta", {
                    "type": "content_block_delta", "index": self.index,
                    "delta": {"type": "signature_delta", "signature": ""}}))
            self.out.append(_event("content_block_stop", {"type": "content_block_stop",
                                                          "index": self.index}))
            self.kind = None


async def count_tokens(request: web.Request) -> web.Response:
    req = decode_body(await request.read(), schema.CountTokensRequest)
    msgs = schema.chat_messages(req)
    tools, _, offered = schema.tools_and_choice(req)
    job = GenerationRequest(model=req.model, sampling=count_only(), id_prefix="count",
                            messages=msgs, count_only=True, images=schema.chat_images(req),
                            tools=[t.as_template_tool() for t in tools] if offered else None)
    async with started_generation(request.app[STATE], job) as gen:
        await gen.collect()
        return web.json_response({"input_tokens": gen.prompt_tokens})


def _model(m: dict) -> dict:
    """A served model in Anthropic's model shape."""
    created = datetime.fromtimestamp(m["created"], UTC).isoformat().replace("+00:00", "Z")
    return {"type": "model", "id": m["id"], "display_name": m["id"], "created_at": created}


def _limit(raw: str | None) -> int:
    try:
        n = int(raw) if raw is not None else 20
    except ValueError:
        n = 0
    if not 1 <= n <= 1000:
        raise bad_request("limit: Input should be an integer from 1 to 1000")
    return n


async def list_models(request: web.Request) -> web.Response:
    """`GET /v1/models` with `anthropic-version`: Anthropic's page of models (`limit`,
    `after_id`, `before_id`)."""
    models = [_model(m) for m in served_models(request.app[STATE])]
    limit, ids = _limit(request.query.get("limit")), [m["id"] for m in models]
    after, before = request.query.get("after_id"), request.query.get("before_id")
    if before is not None:
        end = ids.index(before) if before in ids else len(ids)
        page, has_more = models[max(end - limit, 0):end], end - limit > 0
    else:
        begin = ids.index(after) + 1 if after in ids else 0
        page, has_more = models[begin:begin + limit], begin + limit < len(models)
    return web.json_response({"data": page, "has_more": has_more,
                              "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None})


async def retrieve_model(request: web.Request) -> web.Response:
    return web.json_response(_model(find_model(request.app[STATE],
                                               request.match_info["model"])))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)

