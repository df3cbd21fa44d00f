"""OpenAI-compatible routes (runs in the proxy): chat completions, completions, models."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from mlxd.protocol import stage_trace
from mlxd.protocol.messages import Delta
from mlxd.proxy.bounds import decode_body
from mlxd.proxy.core import constraints
from mlxd.proxy.core.generation import (
    Collected,
    Generation,
    GenerationRequest,
    started_generations,
    usage,
)
from mlxd.proxy.core.keepalive import with_pings
from mlxd.proxy.core.model_list import find_model, served_models
from mlxd.proxy.core.validation import keep_alive_seconds
from mlxd.proxy.dialects.openai.schema import (
    ChatRequest,
    CompletionRequest,
    chat_images,
    chat_messages,
    check_chat_fields,
    choices,
    completion_prompt,
    sampling,
)
from mlxd.proxy.errors import APIError, bad_request
from mlxd.proxy.state import STATE


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


@dataclass(frozen=True)
class _Shape:
    """How one endpoint's answers look: chat messages (maybe one forced tool call each) or
    completion texts (maybe echoing the prompt)."""
    obj: str  # "chat.completion" | "text_completion"
    forced: list[constraints.Tool] | None = None  # the whole output is a call among these
    echo: str = ""  # completions' `echo`: each answer starts with the prompt

    @property
    def chat(self) -> bool:
        return self.obj == "chat.completion"

    def choice(self, i: int, got: Collected, want_logprobs: bool) -> dict:
        finish = got.finish_reason
        if not self.chat:
            return {"index": i, "text": self.echo + got.text, "finish_reason": finish,
                    "logprobs": _logprobs(self.obj, got.logprobs, len(self.echo))
                    if want_logprobs else None}
        message: dict[str, Any] = {"role": "assistant", "content": got.text}
        calls = [self.forced_call(got.text)] if self.forced else \
            [_call(c) for c in got.tool_calls]
        if got.reasoning:
            message["reasoning_content"] = got.reasoning
        if calls:
            message["tool_calls"] = calls
            message["content"] = None if self.forced else got.text or None
            finish = "tool_calls" if finish == "stop" else finish
        return {"index": i, "message": message, "finish_reason": finish,
                "logprobs": _logprobs(self.obj, got.logprobs, 0)
                if want_logprobs and not self.forced else None}

    def forced_call(self, text: str) -> dict:
        """A forced call's output (a length limit may have cut it: it is still a call)."""
        assert self.forced
        name, args = constraints.forced_call(text, self.forced)
        return {"id": constraints.new_call_id(), "type": "function",
                "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


async def _run(request: web.Request, req: ChatRequest | CompletionRequest,
               job: GenerationRequest, shape: _Shape) -> web.StreamResponse:
    async with started_generations(request.app[STATE], job, choices(req)) as gens:
        if not req.stream:
            return await _whole(gens, shape)
        return await _stream(request, gens, shape, _include_usage(req))


async def _whole(gens: list[Generation], shape: _Shape) -> web.Response:
    want_logprobs = gens[0].msg.sampling.logprobs >= 0
    tasks = [asyncio.ensure_future(g.collect()) for g in gens]
    try:
        got = await asyncio.gather(*tasks)
    finally:  # one answer failed: the others stop too
        for t in tasks:
            t.cancel()
    return web.json_response({
        "id": _rid(gens), "object": shape.obj, "created": int(time.time()),
        "model": gens[0].model_name, "system_fingerprint": None,
        "choices": [shape.choice(i, g, want_logprobs) for i, g in enumerate(got)],
        "usage": usage(gens)})


def _rid(gens: list[Generation]) -> str:
    return gens[0].msg.prefill_group or gens[0].msg.request_id


class _Deltas:
    """The deltas of every answer as they come, with the answer's index."""

    def __init__(self, gens: list[Generation]) -> None:
        self.gens = gens
        self.queue: asyncio.Queue[tuple[int, Delta | None, Exception | None]] = \
            asyncio.Queue()
        self.tasks: list[asyncio.Task] = []

    async def __aiter__(self) -> AsyncIterator[tuple[int, Delta]]:
        if len(self.gens) == 1:
            async for d in self.gens[0].deltas():
                yield 0, d
            return
        self.tasks = [asyncio.create_task(self._pump(i, g)) for i, g in enumerate(self.gens)]
        left = len(self.gens)
        while left:
            i, got, error = await self.queue.get()
            if error is not None:
                raise error
            if got is None:
                left -= 1
            else:
                yield i, got

    async def _pump(self, i: int, gen: Generation) -> None:
        try:
            async for d in gen.deltas():
                self.queue.put_nowait((i, d, None))
            self.queue.put_nowait((i, None, None))
        except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
            self.queue.put_nowait((i, None, e))

    def pending(self) -> bool:
        """Whether a delta is already queued (a writer may batch it with this one)."""
        if len(self.gens) == 1:
            return self.gens[0].pending()
        return not self.queue.empty()

    def close(self) -> None:
        for t in self.tasks:
            t.cancel()


async def _stream(request: web.Request, gens: list[Generation], shape: _Shape,
                  include_usage: bool) -> web.StreamResponse:
    n = len(gens)
    want_logprobs = gens[0].msg.sampling.logprobs >= 0
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    base = {"id": _rid(gens), "object": shape.obj + ".chunk" if shape.chat else shape.obj,
            "created": int(time.time()), "model": gens[0].model_name,
            "system_fingerprint": None}

    def chunk(i: int, text: str | None = None, finish: str | None = None,
              **delta: Any) -> dict:
        if shape.chat:
            if text is not None:
                delta["content"] = text
            return {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": i, "text": text or "", "logprobs": None, "finish_reason": finish}

    out: list[bytes] = []
    for i in range(n):  # chat: the role first; completions with echo: the prompt first
        if shape.chat:
            out.append(_sse({**base, "choices": [chunk(i, "", role="assistant")]}))
        elif shape.echo:
            out.append(_sse({**base, "choices": [chunk(i, shape.echo)]}))
    templates = [_ChunkTemplate({**base, "choices": [chunk(i, _MARK)]}) for i in range(n)]
    offsets = [len(shape.echo)] * n
    calls = [0] * n
    held = [""] * n  # a forced call's text, sent as one call once complete
    deltas = _Deltas(gens)
    trace = None
    if stage_trace.ON:
        from mlxd.proxy.stage_trace import StreamTrace
        trace = StreamTrace()
    try:
        async for got in with_pings(aiter(deltas), request.app[STATE].stream_ping):
            if got is None:  # nothing to send for a while (a long prefill): an SSE comment
                await resp.write(b"".join(out) + b": keep-alive\n\n")
                out.clear()
                continue
            i, d = got
            stamps = trace.handler(d) if trace is not None else None
            if d.reasoning and shape.chat:
                out.append(_sse({**base, "choices": [chunk(i, reasoning_content=d.reasoning)]}))
            if d.tool_calls and shape.chat:
                out.append(_sse({**base, "choices": [chunk(i, tool_calls=[
                    {"index": calls[i] + j, **_call(c)} for j, c in enumerate(d.tool_calls)])]}))
                calls[i] += len(d.tool_calls)
            if shape.forced:
                held[i] += d.text
            elif want_logprobs and d.logprobs:
                c = chunk(i, d.text)
                c["logprobs"] = _logprobs(shape.obj, d.logprobs, offsets[i])
                out.append(_sse({**base, "choices": [c]}))
            elif d.text:
                out.append(templates[i].render(d.text))
            offsets[i] += len(d.text)
            if trace is not None:
                trace.built(d, stamps, offsets[i])
            if d.finish_reason is not None:
                reason: str = d.finish_reason
                if shape.forced:
                    out.append(_sse({**base, "choices": [chunk(i, tool_calls=[
                        {"index": 0, **shape.forced_call(held[i])}])]}))
                    calls[i] += 1
                if calls[i] and reason == "stop":
                    reason = "tool_calls"
                out.append(_sse({**base, "choices": [chunk(i, finish=reason)]}))
            if not deltas.pending():  # one write for whatever has queued up meanwhile
                await resp.write(b"".join(out))
                out.clear()
                if trace is not None:
                    trace.written()
        if out:
            await resp.write(b"".join(out))
        if include_usage:
            await resp.write(_sse({**base, "choices": [], "usage": usage(gens)}))
        await resp.write(b"data: [DONE]\n\n")
    except APIError as e:  # after streaming started: one in-band error event, then close
        await resp.write(b"".join(out) + _sse(e.body()))
    finally:
        deltas.close()
        if trace is not None:
            trace.close()
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
    check_chat_fields(req)
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
    job = _generation_request(request, req, "chatcmpl", messages=messages, grammar=grammar,
                              tools=template_tools, images=chat_images(req))
    return await _run(request, req, job, _Shape("chat.completion", forced=forced))


async def completions(request: web.Request) -> web.StreamResponse:
    req = decode_body(await request.read(), CompletionRequest)
    prompt, token_ids = completion_prompt(req)
    job = _generation_request(request, req, "cmpl", prompt=prompt, prompt_token_ids=token_ids,
                              suffix=req.suffix, echo_prompt=bool(req.echo) and prompt is None)
    if not req.echo:
        return await _run(request, req, job, _Shape("text_completion"))
    async with started_generations(request.app[STATE], job, choices(req)) as gens:
        shape = _Shape("text_completion", echo=prompt if prompt is not None
                       else gens[0].prompt_text)
        if not req.stream:
            return await _whole(gens, shape)
        return await _stream(request, gens, shape, _include_usage(req))


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": served_models(request.app[STATE])})


async def retrieve_model(request: web.Request) -> web.Response:
    """`GET /v1/models/{id}`: the model by any name it answers to (paths and repo ids, with
    their slashes, included)."""
    return web.json_response(find_model(request.app[STATE], request.match_info["model"]))


def add_routes(app: web.Application) -> None:
    """`/v1/models` is added by `proxy/model_routes.py` (it answers in Anthropic's shape too)."""
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
