"""OpenAI-compatible routes (runs in the proxy): chat completions, completions, models."""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

from mlxd.proxy import constraints
from mlxd.proxy.bounds import decode_body
from mlxd.proxy.dialects.openai.schema import (
    ChatRequest,
    CompletionRequest,
    chat_messages,
    completion_prompt,
    sampling,
)
from mlxd.proxy.errors import APIError, bad_request
from mlxd.proxy.generation import Generation, GenerationRequest, started_generation
from mlxd.proxy.state import STATE
from mlxd.proxy.validation import keep_alive_seconds


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


_MARK = "\x00text\x00"


class _ChunkTemplate:
    """A stream's content chunk serialized once, with a hole for the text: per token only the
    text is JSON-encoded (the same bytes `_sse` would produce for the whole chunk)."""

    def __init__(self, obj: Any) -> None:
        whole = _sse(obj)
        hole = json.dumps(_MARK).encode()
        self.head, self.tail = whole.split(hole)

    def render(self, text: str) -> bytes:
        return self.head + json.dumps(text, ensure_ascii=False).encode() + self.tail


def _generation_request(request: web.Request, req: ChatRequest | CompletionRequest,
                        prefix: str, **fields: Any) -> GenerationRequest:
    """Checked before any model is touched: keep_alive, then sampling."""
    keep_alive = keep_alive_seconds(req.keep_alive)
    return GenerationRequest(model=req.model, keep_alive=keep_alive, id_prefix=prefix,
                             sampling=sampling(req, request.app[STATE].defaults), **fields)


def _include_usage(req: ChatRequest | CompletionRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


async def _run(request: web.Request, req: ChatRequest | CompletionRequest, prefix: str,
               obj: str, make_choice: Any, **fields: Any) -> web.StreamResponse:
    job = _generation_request(request, req, prefix, **fields)
    async with started_generation(request.app[STATE], job) as gen:
        return await _respond(request, gen, gen.msg.request_id, obj, req.stream,
                              _include_usage(req), make_choice)


async def _respond(request: web.Request, gen: Generation, rid: str, obj: str, stream: bool,
                   include_usage: bool, make_choice: Any) -> web.StreamResponse:
    created = int(time.time())
    model = gen.engine.model_id
    want_logprobs = gen.msg.sampling.logprobs >= 0
    if not stream:
        got = await gen.collect()
        choice = make_choice(got.text, got.finish_reason, final=True)
        if "message" in choice:  # chat
            if got.reasoning:
                choice["message"]["reasoning_content"] = got.reasoning
            if got.tool_calls:
                choice["message"]["tool_calls"] = [_call(c) for c in got.tool_calls]
                choice["message"]["content"] = got.text or None
                if got.finish_reason == "stop":
                    choice["finish_reason"] = "tool_calls"
        if want_logprobs:
            choice["logprobs"] = _logprobs(obj, got.logprobs, 0)
        return web.json_response({
            "id": rid, "object": obj, "created": created, "model": model,
            "system_fingerprint": None, "choices": [choice], "usage": gen.usage()})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    base = {"id": rid, "object": obj + ".chunk" if obj == "chat.completion" else obj,
            "created": created, "model": model, "system_fingerprint": None}
    first = make_choice(None, None, final=False, first=True)
    if first is not None:
        await resp.write(_sse({**base, "choices": [first]}))
    chunk = _ChunkTemplate({**base, "choices": [make_choice(_MARK, None, final=False)]})
    out: list[bytes] = []
    try:
        offset = 0
        n_calls = 0
        async for d in gen.deltas():
            if d.reasoning and obj == "chat.completion":
                out.append(_sse({**base, "choices": [{
                    "index": 0, "delta": {"reasoning_content": d.reasoning},
                    "logprobs": None, "finish_reason": None}]}))
            if d.tool_calls and obj == "chat.completion":
                out.append(_sse({**base, "choices": [{"index": 0, "delta": {"tool_calls": [
                    {"index": n_calls + i, **_call(c)} for i, c in enumerate(d.tool_calls)]},
                    "logprobs": None, "finish_reason": None}]}))
                n_calls += len(d.tool_calls)
            if want_logprobs and d.logprobs:
                c = make_choice(d.text, None, final=False)
                c["logprobs"] = _logprobs(obj, d.logprobs, offset)
                out.append(_sse({**base, "choices": [c]}))
            elif d.text:
                out.append(chunk.render(d.text))
            offset += len(d.text)
            if d.finish_reason is not None:
                reason = "tool_calls" if n_calls and d.finish_reason == "stop" \
                    else d.finish_reason
                out.append(_sse({**base, "choices": [make_choice("", reason,
                                                                 final=False, last=True)]}))
            if not gen.pending():  # one write for whatever has queued up meanwhile
                await resp.write(b"".join(out))
                out.clear()
        if out:
            await resp.write(b"".join(out))
        if include_usage:
            await resp.write(_sse({**base, "choices": [], "usage": gen.usage()}))
        await resp.write(b"data: [DONE]\n\n")
    except APIError as e:  # after streaming started: one in-band error event, then close
        await resp.write(b"".join(out) + _sse(e.body()))
    await resp.write_eof()
    return resp


def _call(c: dict) -> dict:
    """A tool call the engine parsed from the model's own format, in OpenAI's shape."""
    return {"id": constraints.new_call_id(), "type": "function",
            "function": {"name": c["name"], "arguments": c["arguments"]}}


def _logprobs(obj: str, entries: Any, offset: int) -> dict:
    """OpenAI's logprobs object: chat's `content` list, or the legacy completions shape."""
    if obj == "chat.completion":
        return {"content": [{"token": e.token, "logprob": e.logprob,
                             "bytes": list(e.token.encode()),
                             "top_logprobs": [{"token": t, "logprob": v,
                                               "bytes": list(t.encode())} for t, v in e.top]}
                            for e in entries], "refusal": None}
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t: v for t, v in e.top} for e in entries],
            "text_offset": offsets}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    req = decode_body(await request.read(), ChatRequest)
    messages = chat_messages(req)
    tools = constraints.parse_tools(req.tools)
    forced = constraints.forced_tools(tools, req.tool_choice)
    grammar = constraints.response_format_grammar(req.response_format)
    if forced is not None:
        if grammar is not None:
            raise bad_request("`response_format` and a forced `tool_choice` exclude each other",
                              param="response_format")
        grammar = constraints.call_grammar(forced)
    template_tools = [t.as_template_tool() for t in tools] \
        if tools and req.tool_choice != "none" else None
    if forced is None:
        return await _run(request, req, "chatcmpl", "chat.completion", _chat_choice,
                          messages=messages, grammar=grammar, tools=template_tools)
    job = _generation_request(request, req, "chatcmpl", messages=messages, grammar=grammar,
                              tools=template_tools)
    async with started_generation(request.app[STATE], job) as gen:
        return await _respond_tool_call(request, gen, req.stream, _include_usage(req))


async def _respond_tool_call(request: web.Request, gen: Generation, stream: bool,
                             include_usage: bool) -> web.StreamResponse:
    """A forced call: the grammar makes the whole output one call, sent as `tool_calls`
    (in one delta when streaming: its arguments are complete only at the end)."""
    rid, created, model = gen.msg.request_id, int(time.time()), gen.engine.model_id
    base = {"id": rid, "created": created, "model": model, "system_fingerprint": None}
    resp = None
    if stream:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        await resp.write(_sse({**base, "object": "chat.completion.chunk", "choices": [
            _chat_choice(None, None, final=False, first=True)]}))
    try:
        got = await gen.collect()
    except APIError as e:
        if resp is None:
            raise
        await resp.write(_sse(e.body()))
        await resp.write_eof()
        return resp
    text, finish = got.text, got.finish_reason
    parsed = constraints.forced_call(text, finish)
    call = None if parsed is None else {
        "id": constraints.new_call_id(), "type": "function",
        "function": {"name": parsed[0], "arguments": json.dumps(parsed[1], ensure_ascii=False)}}
    finish_reason = "tool_calls" if call else (finish or "stop")
    if resp is None:
        message: dict[str, Any] = {"role": "assistant", "content": None if call else text}
        if call:
            message["tool_calls"] = [call]
        return web.json_response({**base, "object": "chat.completion", "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}],
            "usage": gen.usage()})
    delta = {"tool_calls": [{"index": 0, **call}]} if call else {"content": text}
    chunk = {**base, "object": "chat.completion.chunk"}
    out = _sse({**chunk, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": None}]})
    out += _sse({**chunk, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                       "finish_reason": finish_reason}]})
    if include_usage:
        out += _sse({**chunk, "choices": [], "usage": gen.usage()})
    await resp.write(out + b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _chat_choice(text: str | None, finish: str | None, final: bool, first: bool = False,
                 last: bool = False) -> dict:
    if final:
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": finish}
    if first:
        delta: dict = {"role": "assistant", "content": ""}
    elif last:
        delta = {}
    else:
        delta = {"content": text}
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


async def completions(request: web.Request) -> web.StreamResponse:
    req = decode_body(await request.read(), CompletionRequest)
    prompt, token_ids = completion_prompt(req)
    return await _run(request, req, "cmpl", "text_completion", _completion_choice,
                      prompt=prompt, prompt_token_ids=token_ids)


def _completion_choice(text: str | None, finish: str | None, final: bool, first: bool = False,
                       last: bool = False) -> dict | None:
    if first:
        return None
    return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}


async def list_models(request: web.Request) -> web.Response:
    """Resident and configured models, with their state."""
    proxy = request.app[STATE]
    client, router = proxy.client, proxy.router
    resident = router.pool.resident if router.pool is not None else client.engines
    data: list[dict[str, Any]] = []
    for rec in client.engines.values():
        state = rec.state if rec.engine_id in resident or rec.state == "failed" else "unloaded"
        data.append({"id": rec.model_id, "object": "model", "created": proxy.started,
                     "owned_by": "mlxd", "state": state, "aliases": rec.names})
    listed = {n for d in data for n in d["aliases"]}
    for alias, spec in router.aliases.items():
        if alias not in listed:
            data.append({"id": alias, "object": "model", "created": proxy.started,
                         "owned_by": "mlxd", "state": "unloaded", "aliases": [alias, spec]})
    return web.json_response({"object": "list", "data": data})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
