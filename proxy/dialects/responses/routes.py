"""`POST /v1/responses` (streaming and not), `GET` and `DELETE /v1/responses/{id}` (runs in
the proxy). One generation's deltas become output items (reasoning, message, function calls)
through `_Output`, which also writes the stream's events as the items form, so a streamed and
a whole response are built by the same code and end in the same response object."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from mlxd.protocol.messages import Delta, TokenLogprob
from mlxd.proxy.bounds import clip, decode_body
from mlxd.proxy.core import constraints
from mlxd.proxy.core.generation import Generation, GenerationRequest, started_generation
from mlxd.proxy.core.validation import keep_alive_seconds
from mlxd.proxy.dialects.responses.schema import (
    ResponsesRequest,
    check_fields,
    input_items,
    input_messages,
    sampling,
    split_images,
    text_format,
    tools,
)
from mlxd.proxy.dialects.responses.store import MAX_RESPONSES, RESPONSE_STORE, ResponseStore
from mlxd.proxy.errors import APIError, bad_request
from mlxd.proxy.state import STATE

Emit = Callable[[str, dict], None]


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class _Job:
    """One checked request: the generation to run and what its response echoes."""
    req: ResponsesRequest
    response_id: str
    conversation: list[dict]  # earlier turns and this input, as chat messages (no system)
    generation: GenerationRequest
    forced: list[constraints.Tool] | None
    text_format: dict
    logprobs: bool
    input_items: list[dict]  # as `GET /v1/responses/{id}/input_items` lists them


def _job(request: web.Request, req: ResponsesRequest) -> _Job:
    """Every check before any model is touched."""
    check_fields(req)
    earlier: list[dict] = []
    if req.previous_response_id is not None:
        prior = request.app[RESPONSE_STORE].get(req.previous_response_id)
        if prior is None:
            raise bad_request(f"previous response {clip(req.previous_response_id, 80)!r} not "
                              f"found: mlxd keeps the latest {MAX_RESPONSES} responses stored "
                              "while it runs", code="previous_response_not_found",
                              param="previous_response_id")
        earlier = prior.conversation
    conversation = [*earlier, *input_messages(req.input, earlier)]
    if not any(m["content"] or m.get("tool_calls") for m in conversation):
        raise bad_request("`input` is empty", param="input")
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    fn = tools(req)
    fmt, grammar = text_format(req)
    if fn.forced is not None:  # the whole output is a call: no text for `text.format`
        grammar = constraints.call_grammar(fn.forced)
    checked = sampling(req, request.app[STATE].defaults)
    messages, images = split_images([*system, *conversation])
    generation = GenerationRequest(
        model=req.model, sampling=checked, id_prefix="resp",
        keep_alive=keep_alive_seconds(req.keep_alive), messages=messages,
        grammar=grammar, tools=fn.template, images=images)
    return _Job(req, _new_id("resp"), conversation, generation, fn.forced, fmt,
                checked.params.logprobs >= 0, input_items(req.input, _new_id))


class _Output:
    """The response's output items as the deltas form them. With `emit`, each change is
    also a stream event (`response.output_item.added`, `...output_text.delta`, ...)."""

    def __init__(self, job: _Job, emit: Emit | None = None) -> None:
        self.job = job
        self.emit: Emit = emit or (lambda kind, payload: None)
        self.items: list[dict] = []
        self._message: dict | None = None  # the open items
        self._reasoning: dict | None = None
        self._held = ""  # a forced call's text, a call once complete
        self.text = ""
        self.calls: list[dict] = []  # chat-template shaped, for the stored conversation

    def add(self, d: Delta) -> None:
        if d.reasoning:
            self._think(d.reasoning)
        if self.job.forced:
            self._held += d.text
        elif d.text:
            self._say(d.text, d.logprobs or [])
        for call in d.tool_calls or ():
            self._call(call["name"], call["arguments"])

    def finish(self, cut: bool) -> None:
        if self.job.forced:
            name, args = constraints.forced_call(self._held, self.job.forced)
            self._call(name, json.dumps(args, ensure_ascii=False))
        if not self.items:
            self._open_message()
        self._close(cut)

    # ------------------------------------------------------------------ items

    def _added(self, item: dict) -> int:
        self.items.append(item)
        index = len(self.items) - 1
        self.emit("response.output_item.added", {"output_index": index, "item": item})
        return index

    def _think(self, text: str) -> None:
        if self._reasoning is None:
            self._close(False)
            self._reasoning = {"id": _new_id("rs"), "type": "reasoning", "summary": [],
                               "content": [], "status": "in_progress"}
            index = self._added(self._reasoning)
            part = {"type": "reasoning_text", "text": ""}
            self.emit("response.content_part.added", {
                "item_id": self._reasoning["id"], "output_index": index, "content_index": 0,
                "part": part})
            self._reasoning["content"] = [dict(part)]
        self._reasoning["content"][0]["text"] += text
        self.emit("response.reasoning_text.delta", {
            "item_id": self._reasoning["id"], "output_index": len(self.items) - 1,
            "content_index": 0, "delta": text})

    def _open_message(self) -> dict:
        self._close(False)
        self._message = {"id": _new_id("msg"), "type": "message", "status": "in_progress",
                         "role": "assistant", "content": []}
        index = self._added(self._message)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.emit("response.content_part.added", {
            "item_id": self._message["id"], "output_index": index, "content_index": 0,
            "part": part})
        self._message["content"] = [{**part, "logprobs": []}]
        return self._message

    def _say(self, text: str, logprobs: list[TokenLogprob]) -> None:
        message = self._message or self._open_message()
        part = message["content"][0]
        part["text"] += text
        self.text += text
        entries = [_logprob(e) for e in logprobs] if self.job.logprobs else []
        part["logprobs"].extend(entries)
        self.emit("response.output_text.delta", {
            "item_id": message["id"], "output_index": len(self.items) - 1, "content_index": 0,
            "delta": text, "logprobs": [_delta_logprob(e) for e in entries]})

    def _call(self, name: str, arguments: str) -> None:
        self._close(False)
        item = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress",
                "call_id": constraints.new_call_id(), "name": name, "arguments": ""}
        index = self._added(item)
        self.emit("response.function_call_arguments.delta", {
            "item_id": item["id"], "output_index": index, "delta": arguments})
        item["arguments"], item["status"] = arguments, "completed"
        self.emit("response.function_call_arguments.done", {
            "item_id": item["id"], "output_index": index, "name": name,
            "arguments": arguments})
        self.emit("response.output_item.done", {"output_index": index, "item": item})
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = {}
        self.calls.append({"id": item["call_id"], "type": "function", "function": {
            "name": name, "arguments": parsed if isinstance(parsed, dict) else {}}})

    def _close(self, cut: bool) -> None:
        """End the open message or reasoning item (a message cut by the length limit is
        `incomplete`)."""
        index = len(self.items) - 1
        if self._reasoning is not None:
            item, self._reasoning = self._reasoning, None
            part = item["content"][0]
            self.emit("response.reasoning_text.done", {
                "item_id": item["id"], "output_index": index, "content_index": 0,
                "text": part["text"]})
            self.emit("response.content_part.done", {
                "item_id": item["id"], "output_index": index, "content_index": 0,
                "part": part})
            item["status"] = "completed"
            self.emit("response.output_item.done", {"output_index": index, "item": item})
        if self._message is not None:
            item, self._message = self._message, None
            part = item["content"][0]
            self.emit("response.output_text.done", {
                "item_id": item["id"], "output_index": index, "content_index": 0,
                "text": part["text"], "logprobs": [_delta_logprob(e) for e in part["logprobs"]]})
            self.emit("response.content_part.done", {
                "item_id": item["id"], "output_index": index, "content_index": 0,
                "part": part})
            item["status"] = "incomplete" if cut else "completed"
            self.emit("response.output_item.done", {"output_index": index, "item": item})

    def turn(self) -> dict:
        """This response as an assistant turn, for the stored conversation."""
        turn: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.calls:
            turn["tool_calls"] = self.calls
        return turn


def _logprob(e: TokenLogprob) -> dict:
    return {"token": e.token, "bytes": list(e.token.encode()), "logprob": e.logprob,
            "top_logprobs": [{"token": t, "bytes": list(t.encode()), "logprob": v}
                             for t, v in e.top]}


def _delta_logprob(e: dict) -> dict:
    return {"token": e["token"], "logprob": e["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]}
                             for t in e["top_logprobs"]]}


def _response(job: _Job, model: str, status: str, output: list[dict],
              usage: dict | None = None, error: dict | None = None) -> dict:
    req, params = job.req, job.generation.sampling.params
    return {
        "id": job.response_id, "object": "response", "created_at": int(time.time()),
        "status": status, "background": False, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
        else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": None, "model": model, "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None}, "service_tier": "default",
        "store": req.store is not False, "temperature": params.temperature,
        "text": {"format": job.text_format}, "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [], "top_logprobs": req.top_logprobs, "top_p": params.top_p,
        "truncation": "disabled", "usage": usage, "user": req.user,
        "metadata": req.metadata or {}}


def _usage(gen: Generation) -> dict:
    return {"input_tokens": gen.prompt_tokens,
            "input_tokens_details": {"cached_tokens": gen.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": gen.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": gen.prompt_tokens + gen.completion_tokens}


def _store(request: web.Request, job: _Job, out: _Output, response: dict) -> None:
    if job.req.store is not False:
        request.app[RESPONSE_STORE].put(job.response_id, [*job.conversation, out.turn()],
                                        response, job.input_items)


async def create_response(request: web.Request) -> web.StreamResponse:
    job = _job(request, decode_body(await request.read(), ResponsesRequest))
    async with started_generation(request.app[STATE], job.generation) as gen:
        if job.req.stream:
            return await _stream(request, job, gen)
        out = _Output(job)
        finish = None
        async for d in gen.deltas():
            out.add(d)
            finish = d.finish_reason
        out.finish(cut=finish == "length")
        status = "incomplete" if finish == "length" else "completed"
        response = _response(job, gen.engine.model_id, status, out.items, _usage(gen))
    _store(request, job, out, response)
    return web.json_response(response, dumps=lambda o: json.dumps(o, ensure_ascii=False))


async def _stream(request: web.Request, job: _Job, gen: Generation) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    pending: list[bytes] = []
    sequence = 0

    def emit(kind: str, payload: dict) -> None:
        nonlocal sequence
        data = json.dumps({"type": kind, **payload, "sequence_number": sequence},
                          ensure_ascii=False)
        sequence += 1
        pending.append(f"event: {kind}\ndata: {data}\n\n".encode())

    model = gen.engine.model_id
    out = _Output(job, emit)
    emit("response.created", {"response": _response(job, model, "in_progress", [])})
    emit("response.in_progress", {"response": _response(job, model, "in_progress", [])})
    finish = None
    try:
        async for d in gen.deltas():
            out.add(d)
            finish = d.finish_reason
            if not gen.pending():  # one write for whatever has queued up meanwhile
                await resp.write(b"".join(pending))
                pending.clear()
        out.finish(cut=finish == "length")
        status = "incomplete" if finish == "length" else "completed"
        response = _response(job, model, status, out.items, _usage(gen))
        emit(f"response.{status}", {"response": response})
        _store(request, job, out, response)
    except APIError as e:  # after streaming started: an error event, then the failed response
        emit("error", {"code": e.code, "message": e.message, "param": e.param})
        emit("response.failed", {"response": _response(
            job, model, "failed", out.items, error={"code": e.code or "server_error",
                                                    "message": e.message})})
    await resp.write(b"".join(pending))
    await resp.write_eof()
    return resp


def _stored(request: web.Request) -> tuple[ResponseStore, str]:
    store, rid = request.app[RESPONSE_STORE], request.match_info["response_id"]
    if store.get(rid) is None:
        raise APIError(404, f"no response with id {clip(rid, 80)!r}: mlxd keeps the latest "
                       f"{MAX_RESPONSES} stored responses while it runs",
                       type="invalid_request_error", code="response_not_found")
    return store, rid


async def retrieve_response(request: web.Request) -> web.Response:
    store, rid = _stored(request)
    got = store.get(rid)
    assert got is not None
    return web.json_response(got.response)


async def delete_response(request: web.Request) -> web.Response:
    store, rid = _stored(request)
    store.delete(rid)
    return web.json_response({"id": rid, "object": "response.deleted", "deleted": True})


async def list_input_items(request: web.Request) -> web.Response:
    """`GET /v1/responses/{id}/input_items` (the openai SDK's `responses.input_items.list`):
    the response's own input items, `order` desc (newest first, the default) or asc, `limit`
    1..100 (default 20), after the item `after`."""
    store, rid = _stored(request)
    got = store.get(rid)
    assert got is not None
    q = request.query
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("`order` must be asc or desc", param="order")
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise bad_request("`limit` must be an integer from 1 to 100", param="limit")
    items = got.input_items if order == "asc" else got.input_items[::-1]
    ids = [i["id"] for i in items]
    after = q.get("after")
    begin = ids.index(after) + 1 if after in ids else 0
    page = items[begin:begin + limit]
    return web.json_response({"object": "list", "data": page,
                              "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None,
                              "has_more": begin + limit < len(items)},
                             dumps=lambda o: json.dumps(o, ensure_ascii=False))


def add_routes(app: web.Application) -> None:
    app[RESPONSE_STORE] = ResponseStore()
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", retrieve_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", list_input_items)
