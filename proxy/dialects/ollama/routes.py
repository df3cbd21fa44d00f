"""Ollama's API (runs in the proxy): `/api/chat` and `/api/generate` (NDJSON streaming by
default), `/api/tags`, `/api/show`, `/api/ps`, `/api/version`. Errors are Ollama's
`{"error": "..."}`."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import web

from mlxd.proxy.bounds import decode_body
from mlxd.proxy.core import constraints
from mlxd.proxy.core.generation import Generation, GenerationRequest, started_generation
from mlxd.proxy.core.validation import keep_alive_seconds
from mlxd.proxy.dialects.ollama import pull, weights
from mlxd.proxy.dialects.ollama.schema import (
    ChatRequest,
    GenerateRequest,
    ModelRequest,
    chat_images,
    chat_messages,
    format_grammar,
    generate_images,
    sampling,
    served_name,
    with_images,
)
from mlxd.proxy.engines.client import EngineRecord
from mlxd.proxy.engines.pool import model_weight_bytes
from mlxd.proxy.engines.router import Router
from mlxd.proxy.errors import APIError, bad_request
from mlxd.proxy.state import STATE

API_VERSION = "0.12.0"  # the Ollama API level these routes follow


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


async def chat(request: web.Request) -> web.StreamResponse:
    began = time.perf_counter_ns()
    req = decode_body(await request.read(), ChatRequest)
    state = request.app[STATE]
    keep_alive = keep_alive_seconds(req.keep_alive)
    tools = constraints.parse_tools(req.tools)
    msgs = chat_messages(req)
    name = served_name(req.model, state.router)
    if not msgs:  # Ollama: a chat without messages loads (or with keep_alive 0, unloads)
        return await _load_only(request, name, keep_alive, "message",
                                {"role": "assistant", "content": ""}, began)
    checked = sampling(req, state.defaults)
    job = GenerationRequest(model=name, sampling=checked, id_prefix="ollama",
                            keep_alive=keep_alive, messages=msgs, images=chat_images(req),
                            grammar=format_grammar(req.format),
                            tools=[t.as_template_tool() for t in tools] or None)
    async with started_generation(state, job) as gen:
        return await _respond(request, gen, req.stream is not False, req.model, "message",
                              began)


async def generate(request: web.Request) -> web.StreamResponse:
    began = time.perf_counter_ns()
    req = decode_body(await request.read(), GenerateRequest)
    state = request.app[STATE]
    keep_alive = keep_alive_seconds(req.keep_alive)
    if req.template:
        raise bad_request("`template` is not supported (the model's own chat template is used)")
    if req.context:
        raise bad_request("`context` is not supported (send the conversation to /api/chat)")
    name = served_name(req.model, state.router)
    prompt = req.prompt or ""
    if not prompt and not req.suffix:
        return await _load_only(request, name, keep_alive, "response", "", began)
    checked = sampling(req, state.defaults)
    grammar = format_grammar(req.format)
    if req.suffix:  # fill-in-the-middle, framed by the model's FIM tokens
        job = GenerationRequest(model=name, sampling=checked, id_prefix="ollama",
                                keep_alive=keep_alive, grammar=grammar, prompt=prompt,
                                suffix=req.suffix)
    elif req.raw:  # images come before the prompt's text
        job = GenerationRequest(model=name, sampling=checked, id_prefix="ollama",
                                keep_alive=keep_alive, grammar=grammar, prompt=prompt,
                                images=generate_images(req))
    else:
        msgs = [{"role": "system", "content": req.system}] if req.system else []
        job = GenerationRequest(model=name, sampling=checked, id_prefix="ollama",
                                keep_alive=keep_alive, grammar=grammar,
                                messages=[*msgs, {"role": "user", "content":
                                                  with_images(prompt, req.images)}],
                                images=generate_images(req))
    async with started_generation(state, job) as gen:
        return await _respond(request, gen, req.stream is not False, req.model, "response",
                              began)


async def _load_only(request: web.Request, name: str, keep_alive: float | None, key: str,
                     empty: Any, began: int) -> web.Response:
    router = request.app[STATE].router
    if keep_alive == 0:
        rec = await router.unload(name)
        reason = "unload"
    else:
        rec = await router.load(name)
        reason = "load"
    took = time.perf_counter_ns() - began
    return web.json_response({"model": rec.model_id, "created_at": _now(), key: empty,
                              "done": True, "done_reason": reason, "total_duration": took,
                              **({"load_duration": took} if reason == "load" else {})})


async def _respond(request: web.Request, gen: Generation, stream: bool, model: str,
                   key: str, started: int) -> web.StreamResponse:
    """`key` "message" (chat) or "response" (generate) holds each piece of the answer;
    `started`: when the request came in (perf_counter_ns)."""
    if not stream:
        got = await gen.collect()
        return web.json_response({"model": model, "created_at": _now(),
                                  **_piece(key, got.text, got.reasoning, got.tool_calls),
                                  **_final(gen, got.finish_reason, started)})
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    out: list[bytes] = []
    try:
        async for d in gen.deltas():
            if d.text or d.reasoning or d.tool_calls:
                out.append(_line({"model": model, "created_at": _now(),
                                  **_piece(key, d.text, d.reasoning, d.tool_calls),
                                  "done": False}))
            if d.finish_reason is not None:
                out.append(_line({"model": model, "created_at": _now(), **_piece(key, ""),
                                  **_final(gen, d.finish_reason, started)}))
            if not gen.pending():
                await resp.write(b"".join(out))
                out.clear()
        if out:
            await resp.write(b"".join(out))
    except APIError as e:  # mid-stream: Ollama sends one {"error": ...} line
        await resp.write(b"".join(out) + _line(e.body("ollama")))
    await resp.write_eof()
    return resp


def _piece(key: str, text: str, thought: str = "", calls: list | None = None) -> dict:
    if key == "response":
        return {"response": text, **({"thinking": thought} if thought else {})}
    message: dict = {"role": "assistant", "content": text}
    if thought:
        message["thinking"] = thought
    if calls:
        message["tool_calls"] = [_ollama_call(c) for c in calls]
    return {"message": message}


def _ollama_call(c: dict) -> dict:
    try:
        args = json.loads(c["arguments"])
    except ValueError:
        args = {}
    return {"function": {"name": c["name"], "arguments": args}}


def _line(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"


def _final(gen: Generation, finish: str | None, started_ns: int) -> dict:
    """Ollama's counts and durations (ns), measured: `load_duration` the model load this
    request waited for, `prompt_eval_duration` from handing it to the engine to its first
    token, `eval_duration` from the first token to the last; `total_duration` from the
    request's arrival to now."""
    now = time.perf_counter_ns()
    first = gen.first_token_ns or now
    last = gen.last_token_ns or first
    return {"done": True, "done_reason": "length" if finish == "length" else "stop",
            "total_duration": now - started_ns, "load_duration": gen.load_ns,
            "prompt_eval_count": gen.prompt_tokens,
            "prompt_eval_duration": max(first - gen.sent_ns, 0),
            "eval_count": gen.completion_tokens, "eval_duration": last - first}


# ---------------------------------------------------------------- models

FAR_FUTURE = "9999-12-31T23:59:59Z"  # `expires_at` of a model that never unloads by itself


def _config(model_dir: str) -> dict:
    try:
        cfg = json.loads((Path(model_dir).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _details(model_dir: str) -> dict:
    """Blocking (config.json and the safetensors headers): call it on a worker thread."""
    return weights.details(model_dir, _config(model_dir))


def _model_dir(spec: str, rec: EngineRecord | None) -> str:
    """Where the model's files are: as the engine loaded them (the default model's converted
    directory, a repo id's snapshot), else the spec itself (a local directory)."""
    if rec is not None and rec.status is not None and rec.status.model_dir:
        return rec.status.model_dir
    return spec


def _capabilities(rec: EngineRecord | None) -> list[str]:
    """What the engine found the model can do once it loaded it."""
    if rec is not None and rec.status is not None and rec.status.capabilities:
        return list(rec.status.capabilities)
    return ["completion"]


async def _entry(request: web.Request, name: str, spec: str, rec: EngineRecord | None
                 ) -> dict:
    model_dir = _model_dir(spec, rec)
    return {"name": name, "model": name,
            "modified_at": datetime.fromtimestamp(request.app[STATE].started, UTC).isoformat(),
            "size": await asyncio.to_thread(model_weight_bytes, model_dir),
            "digest": await request.app[weights.DIGESTS].of(model_dir),
            "details": await asyncio.to_thread(_details, model_dir)}


def _expires_at(router: Router, engine_id: str) -> str:
    """When the pool unloads this idle model: its keep_alive, else --idle-unload; never (far
    in the future) when pinned, without a pool, or with neither."""
    pool = router.pool
    r = pool.resident.get(engine_id) if pool is not None else None
    if pool is None or r is None or r.pinned:
        return FAR_FUTURE
    now = time.monotonic()
    if r.keep_until is not None:
        left = r.keep_until - now
    elif pool.idle_unload > 0:
        left = pool.idle_unload - (0.0 if r.in_flight else now - r.last_used)
    else:
        return FAR_FUTURE
    when = datetime.fromtimestamp(time.time() + max(left, 0.0), UTC)
    return when.isoformat().replace("+00:00", "Z")


async def tags(request: web.Request) -> web.Response:
    state = request.app[STATE]
    client, router = state.client, state.router
    seen: dict[str, tuple[str, EngineRecord | None]] = {
        rec.model_id: (rec.spec, rec) for rec in client.engines.values()}
    for alias, spec in router.aliases.items():
        seen.setdefault(alias, (spec, None))
    return web.json_response({"models": [await _entry(request, n, spec, rec)
                                         for n, (spec, rec) in seen.items()]})


async def ps(request: web.Request) -> web.Response:
    state = request.app[STATE]
    client, router = state.client, state.router
    resident = router.pool.resident if router.pool is not None else client.engines
    models = []
    for rec in client.engines.values():
        if rec.engine_id in resident and rec.state == "ready":
            entry = await _entry(request, rec.model_id, rec.spec, rec)
            models.append({**entry, "expires_at": _expires_at(router, rec.engine_id),
                           "size_vram": entry["size"],
                           "context_length": rec.status.context_length if rec.status else 0})
    return web.json_response({"models": models})


def _chat_template(model_dir: Path) -> str:
    try:
        template = json.loads((model_dir / "tokenizer_config.json").read_text()).get(
            "chat_template", "")
    except (OSError, ValueError, AttributeError):
        template = ""
    if not template:  # newer models keep it in a file of its own
        try:
            template = (model_dir / "chat_template.jinja").read_text()
        except OSError:
            template = ""
    return template if isinstance(template, str) else ""


async def show(request: web.Request) -> web.Response:
    req = decode_body(await request.read(), ModelRequest)
    state = request.app[STATE]
    name = req.model or req.name
    if not name:
        raise bad_request("`model` is required")
    name = served_name(name, state.router)
    spec = state.router.lookup(name)
    rec = state.client.find(name)
    model_dir = _model_dir(spec, rec)
    cfg = await asyncio.to_thread(_config, model_dir)
    info = {f"{cfg.get('model_type', 'general')}.{k}": v for k, v in cfg.items()
            if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
    if rec is not None and rec.status is not None:
        info["general.context_length"] = rec.status.context_length
    return web.json_response({"modelfile": "", "parameters": "",
                              "template": _chat_template(Path(model_dir).expanduser()),
                              "details": await asyncio.to_thread(_details, model_dir),
                              "digest": await request.app[weights.DIGESTS].of(model_dir),
                              "model_info": info,
                              "capabilities": _capabilities(rec),
                              "modified_at": datetime.fromtimestamp(
                                  state.started, UTC).isoformat()})


async def root(request: web.Request) -> web.Response:
    return web.Response(text="mlxd is running (OpenAI at /v1, Anthropic at /v1/messages, "
                             "Ollama at /api)")


async def version(request: web.Request) -> web.Response:
    from mlxd import __version__
    return web.json_response({"version": API_VERSION, "mlxd": __version__})


def add_routes(app: web.Application) -> None:
    app[weights.DIGESTS] = weights.Digests()
    app.router.add_post("/api/chat", chat)
    app.router.add_post("/api/generate", generate)
    app.router.add_get("/api/tags", tags)
    app.router.add_post("/api/show", show)
    app.router.add_get("/api/ps", ps)
    app.router.add_get("/api/version", version)
    app.router.add_post("/api/pull", pull.pull)
    app.router.add_get("/", root)
