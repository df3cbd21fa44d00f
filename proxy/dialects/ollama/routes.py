"""Ollama's API (runs in the proxy): `/api/chat` and `/api/generate` (NDJSON streaming by
default), `/api/tags`, `/api/show`, `/api/ps`, `/api/version`. Errors are Ollama's
`{"error": "..."}`."""

from __future__ import annotations

import hashlib
import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import web

from mlxd.proxy import constraints
from mlxd.proxy.bounds import decode_body
from mlxd.proxy.dialects.ollama.schema import (
    ChatRequest,
    GenerateRequest,
    ModelRequest,
    chat_messages,
    format_grammar,
    sampling,
)
from mlxd.proxy.errors import APIError, bad_request
from mlxd.proxy.generation import Generation, GenerationRequest, started_generation
from mlxd.proxy.model_pool import model_weight_bytes
from mlxd.proxy.router import Router
from mlxd.proxy.state import STATE
from mlxd.proxy.validation import keep_alive_seconds

API_VERSION = "0.12.0"  # the Ollama API level these routes follow


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _model_name(name: str, router: Router) -> str:
    """Ollama clients say `name:latest`; mlxd's names carry no tag."""
    if name.endswith(":latest"):
        try:
            router.lookup(name)
        except APIError:
            return name[:-len(":latest")]
    return name


async def chat(request: web.Request) -> web.StreamResponse:
    req = decode_body(await request.read(), ChatRequest)
    state = request.app[STATE]
    keep_alive = keep_alive_seconds(req.keep_alive)
    tools = constraints.parse_tools(req.tools)
    msgs = chat_messages(req)
    name = _model_name(req.model, state.router)
    if not msgs:  # Ollama: a chat without messages loads (or with keep_alive 0, unloads)
        return await _load_only(request, name, keep_alive, "message",
                                {"role": "assistant", "content": ""})
    checked = sampling(req, state.defaults)
    job = GenerationRequest(model=name, sampling=checked, id_prefix="ollama",
                            keep_alive=keep_alive, messages=msgs,
                            grammar=format_grammar(req.format),
                            tools=[t.as_template_tool() for t in tools] or None)
    async with started_generation(state, job) as gen:
        return await _respond(request, gen, req.stream, req.model, "message")


async def generate(request: web.Request) -> web.StreamResponse:
    req = decode_body(await request.read(), GenerateRequest)
    state = request.app[STATE]
    keep_alive = keep_alive_seconds(req.keep_alive)
    if req.images:
        raise bad_request("images are not supported")
    if req.suffix:
        raise bad_request("`suffix` is not supported")
    name = _model_name(req.model, state.router)
    if not req.prompt:
        return await _load_only(request, name, keep_alive, "response", "")
    checked = sampling(req, state.defaults)
    grammar = format_grammar(req.format)
    if req.raw:
        job = GenerationRequest(model=name, sampling=checked, id_prefix="ollama",
                                keep_alive=keep_alive, grammar=grammar, prompt=req.prompt)
    else:
        msgs = [{"role": "system", "content": req.system}] if req.system else []
        job = GenerationRequest(model=name, sampling=checked, id_prefix="ollama",
                                keep_alive=keep_alive, grammar=grammar,
                                messages=[*msgs, {"role": "user", "content": req.prompt}])
    async with started_generation(state, job) as gen:
        return await _respond(request, gen, req.stream, req.model, "response")


async def _load_only(request: web.Request, name: str, keep_alive: float | None, key: str,
                     empty: Any) -> web.Response:
    router = request.app[STATE].router
    if keep_alive == 0:
        rec = await router.unload(name)
        reason = "unload"
    else:
        rec = await router.load(name)
        reason = "load"
    return web.json_response({"model": rec.model_id, "created_at": _now(), key: empty,
                              "done": True, "done_reason": reason})


async def _respond(request: web.Request, gen: Generation, stream: bool, model: str,
                   key: str) -> web.StreamResponse:
    """`key` "message" (chat) or "response" (generate) holds each piece of the answer."""
    started = time.perf_counter_ns()
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
    total = time.perf_counter_ns() - started_ns
    return {"done": True, "done_reason": "length" if finish == "length" else "stop",
            "total_duration": total, "load_duration": 0,
            "prompt_eval_count": gen.prompt_tokens, "prompt_eval_duration": 0,
            "eval_count": gen.completion_tokens, "eval_duration": total}


# ---------------------------------------------------------------- models

def _details(spec: str) -> dict:
    try:
        cfg = json.loads((Path(spec).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    quant = cfg.get("quantization") or {}
    return {"parent_model": "", "format": "mlx", "family": cfg.get("model_type", ""),
            "families": [cfg.get("model_type", "")] if cfg.get("model_type") else None,
            "parameter_size": "", "quantization_level":
                f"Q{quant['bits']}" if isinstance(quant, dict) and quant.get("bits") else ""}


def _entry(name: str, spec: str, started: int) -> dict:
    return {"name": name, "model": name,
            "modified_at": datetime.fromtimestamp(started, UTC).isoformat(),
            "size": model_weight_bytes(spec),
            "digest": hashlib.sha256(spec.encode()).hexdigest(), "details": _details(spec)}


async def tags(request: web.Request) -> web.Response:
    state = request.app[STATE]
    client, router = state.client, state.router
    seen: dict[str, str] = {rec.model_id: rec.spec for rec in client.engines.values()}
    for alias, spec in router.aliases.items():
        seen.setdefault(alias, spec)
    return web.json_response({"models": [_entry(n, s, state.started)
                                         for n, s in seen.items()]})


async def ps(request: web.Request) -> web.Response:
    state = request.app[STATE]
    client, router = state.client, state.router
    resident = router.pool.resident if router.pool is not None else client.engines
    models = []
    for rec in client.engines.values():
        if rec.engine_id in resident and rec.state == "ready":
            size = model_weight_bytes(rec.spec)
            models.append({**_entry(rec.model_id, rec.spec, state.started),
                           "expires_at": "0001-01-01T00:00:00Z", "size_vram": size})
    return web.json_response({"models": models})


async def show(request: web.Request) -> web.Response:
    req = decode_body(await request.read(), ModelRequest)
    state = request.app[STATE]
    name = req.model or req.name
    if not name:
        raise bad_request("`model` is required")
    name = _model_name(name, state.router)
    spec = state.router.lookup(name)
    rec = state.client.find(name)
    path = Path(spec).expanduser()
    try:
        template = json.loads((path / "tokenizer_config.json").read_text()).get(
            "chat_template", "")
    except (OSError, ValueError):
        template = ""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    info = {f"{cfg.get('model_type', 'general')}.{k}": v for k, v in cfg.items()
            if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
    if rec is not None and rec.status is not None:
        info["general.context_length"] = rec.status.context_length
    return web.json_response({"modelfile": "", "parameters": "",
                              "template": template if isinstance(template, str) else "",
                              "details": _details(spec), "model_info": info,
                              "capabilities": ["completion"],
                              "modified_at": datetime.fromtimestamp(
                                  state.started, UTC).isoformat()})


async def root(request: web.Request) -> web.Response:
    return web.Response(text="mlxd is running (OpenAI at /v1, Anthropic at /v1/messages, "
                             "Ollama at /api)")


async def version(request: web.Request) -> web.Response:
    from mlxd import __version__
    return web.json_response({"version": API_VERSION, "mlxd": __version__})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/api/chat", chat)
    app.router.add_post("/api/generate", generate)
    app.router.add_get("/api/tags", tags)
    app.router.add_post("/api/show", show)
    app.router.add_get("/api/ps", ps)
    app.router.add_get("/api/version", version)
    app.router.add_get("/", root)
