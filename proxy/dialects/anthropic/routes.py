"""Anthropic Messages API (runs in the proxy): `POST /v1/messages` (streaming with Anthropic's
event sequence, or not) and `POST /v1/messages/count_tokens`. Errors use Anthropic's envelope
(errors.py picks it from the path)."""

from __future__ import annotations

import json
import uuid

from aiohttp import web

from mlxd.proxy import constraints
from mlxd.proxy.bounds import decode_body
from mlxd.proxy.dialects.anthropic import schema
from mlxd.proxy.errors import APIError
from mlxd.proxy.generation import Generation, GenerationRequest, started_generation
from mlxd.proxy.sampling import count_only
from mlxd.proxy.state import STATE

PING_EVERY = 10  # content deltas between `ping` events


def _event(name: str, data: dict) -> bytes:
    return (f"event: {name}\ndata: ".encode() + json.dumps(data, ensure_ascii=False).encode()
            + b"\n\n")


async def messages(request: web.Request) -> web.StreamResponse:
    req = decode_body(await request.read(), schema.MessagesRequest)
    msgs = schema.chat_messages(req)
    tools, forced, offered = schema.tools_and_choice(req)
    checked = schema.sampling(req, request.app[STATE].defaults)
    job = GenerationRequest(
        model=req.model, sampling=checked, id_prefix="msg", messages=msgs,
        tools=[t.as_template_tool() for t in tools] if offered else None,
        grammar=constraints.call_grammar(forced) if forced else None)
    async with started_generation(request.app[STATE], job) as gen:
        msg_id = "msg_" + uuid.uuid4().hex[:24]
        if forced:
            return await _tool_use(request, gen, msg_id, req.stream)
        if req.stream:
            return await _stream(request, gen, msg_id)
        got = await gen.collect()
        content = [{"type": "thinking", "thinking": got.reasoning, "signature": ""}] \
            if got.reasoning else []
        if got.text or not got.tool_calls:
            content.append({"type": "text", "text": got.text})
        content += [_tool_use_block(c) for c in got.tool_calls]
        return web.json_response({
            "id": msg_id, "type": "message", "role": "assistant", "model": gen.engine.model_id,
            "content": content,
            "stop_reason": "tool_use" if got.tool_calls and got.finish_reason == "stop" else
            schema.stop_reason(got.finish_reason, got.stop_sequence),
            "stop_sequence": got.stop_sequence,
            "usage": schema.usage(gen.prompt_tokens, gen.cached_tokens, gen.completion_tokens)})


async def _stream(request: web.Request, gen: Generation, msg_id: str) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    await resp.write(_event("message_start", {"type": "message_start", "message": {
        "id": msg_id, "type": "message", "role": "assistant", "model": gen.engine.model_id,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": schema.usage(gen.prompt_tokens, gen.cached_tokens, 0)}}))
    await resp.write(_event("ping", {"type": "ping"}))
    out: list[bytes] = []
    blocks = _Blocks(out)
    sent = calls = 0
    try:
        async for d in gen.deltas():
            if d.reasoning:
                blocks.open("thinking")
                out.append(_event("content_block_delta", {
                    "type": "content_block_delta", "index": blocks.index,
                    "delta": {"type": "thinking_delta", "thinking": d.reasoning}}))
            if d.text:
                blocks.open("text")
                out.append(_event("content_block_delta", {
                    "type": "content_block_delta", "index": blocks.index,
                    "delta": {"type": "text_delta", "text": d.text}}))
                sent += 1
                if sent % PING_EVERY == 0:
                    out.append(_event("ping", {"type": "ping"}))
            for call in d.tool_calls or ():
                block = _tool_use_block(call)
                blocks.open("tool_use", {**block, "input": {}})
                out.append(_event("content_block_delta", {
                    "type": "content_block_delta", "index": blocks.index,
                    "delta": {"type": "input_json_delta", "partial_json": call["arguments"]}}))
                calls += 1
            if d.finish_reason is not None:
                if "text" not in blocks.seen and not calls:
                    blocks.open("text")  # an answer has its text block, even if empty
                blocks.close()
                stop = "tool_use" if calls and d.finish_reason == "stop" else \
                    schema.stop_reason(d.finish_reason, d.stop_sequence)
                out.append(_event("message_delta", {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop,
                              "stop_sequence": d.stop_sequence},
                    "usage": {"output_tokens": gen.completion_tokens}}))
                out.append(_event("message_stop", {"type": "message_stop"}))
            if not gen.pending():
                await resp.write(b"".join(out))
                out.clear()
        if out:
            await resp.write(b"".join(out))
    except APIError as e:  # after the stream started: Anthropic's `error` event
        await resp.write(b"".join(out) + _event("error", e.body("anthropic")))
    await resp.write_eof()
    return resp


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


async def _tool_use(request: web.Request, gen: Generation, msg_id: str,
                    stream: bool) -> web.StreamResponse:
    """A forced call (tool_choice any or tool): the whole output is one tool_use block."""
    resp = None
    if stream:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        await resp.write(_event("message_start", {"type": "message_start", "message": {
            "id": msg_id, "type": "message", "role": "assistant",
            "model": gen.engine.model_id, "content": [], "stop_reason": None,
            "stop_sequence": None,
            "usage": schema.usage(gen.prompt_tokens, gen.cached_tokens, 0)}})
            + _event("ping", {"type": "ping"}))
    try:
        got = await gen.collect()
    except APIError as e:
        if resp is None:
            raise
        await resp.write(_event("error", e.body("anthropic")))
        await resp.write_eof()
        return resp
    text = got.text
    parsed = constraints.forced_call(text, got.finish_reason)
    block: dict
    if parsed is not None:
        block = {"type": "tool_use", "id": constraints.new_call_id("toolu_"), "name": parsed[0],
                 "input": parsed[1]}
        stop = "tool_use"
    else:  # cut off by max_tokens
        block = {"type": "text", "text": text}
        stop = schema.stop_reason(got.finish_reason, None)
    usage = schema.usage(gen.prompt_tokens, gen.cached_tokens, gen.completion_tokens)
    if resp is None:
        return web.json_response({
            "id": msg_id, "type": "message", "role": "assistant", "model": gen.engine.model_id,
            "content": [block], "stop_reason": stop, "stop_sequence": None, "usage": usage})
    if block["type"] == "tool_use":
        start = {**block, "input": {}}
        delta = {"type": "input_json_delta",
                 "partial_json": json.dumps(block["input"], ensure_ascii=False)}
    else:
        start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": text}
    await resp.write(
        _event("content_block_start", {"type": "content_block_start", "index": 0,
                                       "content_block": start})
        + _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                         "delta": delta})
        + _event("content_block_stop", {"type": "content_block_stop", "index": 0})
        + _event("message_delta", {"type": "message_delta",
                                   "delta": {"stop_reason": stop, "stop_sequence": None},
                                   "usage": {"output_tokens": gen.completion_tokens}})
        + _event("message_stop", {"type": "message_stop"}))
    await resp.write_eof()
    return resp


async def count_tokens(request: web.Request) -> web.Response:
    req = decode_body(await request.read(), schema.CountTokensRequest)
    msgs = schema.chat_messages(req)
    tools, _, offered = schema.tools_and_choice(req)
    job = GenerationRequest(model=req.model, sampling=count_only(), id_prefix="count",
                            messages=msgs, count_only=True,
                            tools=[t.as_template_tool() for t in tools] if offered else None)
    async with started_generation(request.app[STATE], job) as gen:
        await gen.collect()
        return web.json_response({"input_tokens": gen.prompt_tokens})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)

