"""Ollama's API: `/api/chat` and `/api/generate` (NDJSON streaming by default), `/api/tags`,
`/api/show`, `/api/ps`, `/api/version`. Errors are Ollama's `{"error": "..."}`."""

from __future__ import annotations

import hashlib
import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

import msgspec
from aiohttp import web

from mlxd.proxy import constraints
from mlxd.proxy.bounds import (MAX_COUNT, MAX_IDENT_CHARS, Duration, Ident, ModelName, Seconds,
                               Seed, StopString, TokenId, TopK, decode_body)
from mlxd.proxy.engine_client import EngineRecord
from mlxd.proxy.errors import APIError, bad_request
from mlxd.proxy.generation import Generation
from mlxd.proxy.model_pool import model_weight_bytes
from mlxd.proxy.openai_schema import _Sampling, sampling_params
from mlxd.proxy.router import Router
from mlxd.proxy.run import generation, keep_alive_seconds

API_VERSION = "0.12.0"  # the Ollama API level these routes follow

NumPredict = Annotated[int, msgspec.Meta(ge=-2, le=MAX_COUNT)]  # -1: until done, -2: fill context


class Options(msgspec.Struct, kw_only=True):
    temperature: float | None = None
    top_p: float | None = None
    top_k: TopK | None = None
    min_p: float | None = None
    num_predict: NumPredict | None = None
    stop: list[StopString] | None = None
    seed: Seed | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Ident
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[dict] | None = None
    thinking: str | None = None


class _Common(msgspec.Struct, kw_only=True):
    model: ModelName
    stream: bool = True
    format: Any = None
    options: Options | None = None
    keep_alive: Seconds | Duration | None = None
    think: Any = None


class ChatRequest(_Common, kw_only=True):
    messages: list[ChatMessage] | None = None
    tools: list[dict] | None = None


class GenerateRequest(_Common, kw_only=True):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    images: list[str] | None = None
    template: str | None = None
    context: list[TokenId] | None = None


class ModelRequest(msgspec.Struct, kw_only=True):
    model: ModelName | None = None
    name: ModelName | None = None  # older clients


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _model_name(name: str, router: Router) -> str:
    """Ollama clients say `name:latest`; mlxd's names carry no tag."""
    if name.endswith(":latest"):
        try:
            router.lookup(name)
        except APIError:
            return name[:-len(":latest")]
    return name


def _template_call(call: Any, i: int) -> dict:
    """An earlier assistant tool call ({"function": {"name", "arguments": {...}}})."""
    fn = call.get("function") if isinstance(call, dict) else None
    name = fn.get("name", "") if isinstance(fn, dict) else None
    args = (fn.get("arguments") or {}) if isinstance(fn, dict) else None
    if not isinstance(name, str) or len(name) > MAX_IDENT_CHARS or not isinstance(args, dict):
        raise bad_request(f"messages[{i}].tool_calls: each needs `function` with a `name` (at "
                          f"most {MAX_IDENT_CHARS} characters) and an `arguments` object")
    return {"type": "function", "function": {"name": name, "arguments": args}}


def format_grammar(fmt: Any) -> str | None:
    """Ollama's `format`: "json" (any JSON object) or a JSON schema."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return constraints.schema_grammar(constraints.ANY_OBJECT, "format")
    if isinstance(fmt, dict):
        return constraints.schema_grammar(fmt, "format")
    raise bad_request('`format` must be "json" or a JSON schema object')


def _sampling(req: _Common, defaults: Any) -> tuple[Any, int | None]:
    o = req.options or Options()
    n = o.num_predict
    max_tokens = None if n is None or n < 0 else n  # -1: until done, -2: fill the context
    if n == 0:
        raise bad_request("options.num_predict must not be 0")
    params = sampling_params(_Sampling(
        temperature=o.temperature, top_p=o.top_p, top_k=o.top_k, min_p=o.min_p,
        repetition_penalty=o.repeat_penalty, presence_penalty=o.presence_penalty,
        frequency_penalty=o.frequency_penalty, seed=o.seed, stop=o.stop,
        max_tokens=max_tokens), defaults, max_tokens)
    return params, max_tokens


async def chat(request: web.Request) -> web.StreamResponse:
    req: ChatRequest = decode_body(await request.read(), ChatRequest)  # type: ignore[assignment]
    router: Router = request.app["router"]
    keep_alive = keep_alive_seconds(req.keep_alive)
    tools = constraints.parse_tools(req.tools)
    msgs = []
    for i, m in enumerate(req.messages or []):
        if m.role not in ("system", "user", "assistant", "tool"):
            raise bad_request(f"messages[{i}].role {m.role!r} is not one of system, user, "
                              "assistant, tool")
        if m.images:
            raise bad_request(f"messages[{i}]: images are not supported")
        msg: dict = {"role": m.role, "content": m.content}
        if m.tool_calls:
            msg["tool_calls"] = [_template_call(c, i) for c in m.tool_calls]
        msgs.append(msg)
    name = _model_name(req.model, router)
    if not msgs:  # Ollama: a chat without messages loads (or with keep_alive 0, unloads)
        return await _load_only(request, name, keep_alive, "message",
                                {"role": "assistant", "content": ""})
    params, max_tokens = _sampling(req, request.app["defaults"])
    grammar = format_grammar(req.format)
    async with generation(request, name, params, keep_alive, max_tokens, "ollama",
                          messages=msgs, grammar=grammar,
                          tools=[t.as_template_tool() for t in tools] or None) as gen:
        return await _respond(request, gen, req.stream, req.model, "message")


async def generate(request: web.Request) -> web.StreamResponse:
    req: GenerateRequest = decode_body(  # type: ignore[assignment]
        await request.read(), GenerateRequest)
    router: Router = request.app["router"]
    keep_alive = keep_alive_seconds(req.keep_alive)
    if req.images:
        raise bad_request("images are not supported")
    if req.suffix:
        raise bad_request("`suffix` is not supported")
    name = _model_name(req.model, router)
    if not req.prompt:
        return await _load_only(request, name, keep_alive, "response", "")
    params, max_tokens = _sampling(req, request.app["defaults"])
    grammar = format_grammar(req.format)
    if req.raw:
        fields: dict[str, Any] = {"prompt": req.prompt}
    else:
        msgs = [{"role": "system", "content": req.system}] if req.system else []
        fields = {"messages": msgs + [{"role": "user", "content": req.prompt}]}
    async with generation(request, name, params, keep_alive, max_tokens, "ollama",
                          grammar=grammar, **fields) as gen:
        return await _respond(request, gen, req.stream, req.model, "response")


async def _load_only(request: web.Request, name: str, keep_alive: float | None, key: str,
                     empty: Any) -> web.Response:
    router: Router = request.app["router"]
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
            "modified_at": datetime.fromtimestamp(started, timezone.utc).isoformat(),
            "size": model_weight_bytes(spec),
            "digest": hashlib.sha256(spec.encode()).hexdigest(), "details": _details(spec)}


async def tags(request: web.Request) -> web.Response:
    client, router = request.app["client"], request.app["router"]
    seen: dict[str, str] = {rec.model_id: rec.spec for rec in client.engines.values()}
    for alias, spec in router.aliases.items():
        seen.setdefault(alias, spec)
    return web.json_response({"models": [_entry(n, s, request.app["started"])
                                         for n, s in seen.items()]})


async def ps(request: web.Request) -> web.Response:
    client, router = request.app["client"], request.app["router"]
    resident = router.pool.resident if router.pool is not None else client.engines
    models = []
    for rec in client.engines.values():
        if rec.engine_id in resident and rec.state == "ready":
            size = model_weight_bytes(rec.spec)
            models.append({**_entry(rec.model_id, rec.spec, request.app["started"]),
                           "expires_at": "0001-01-01T00:00:00Z", "size_vram": size})
    return web.json_response({"models": models})


async def show(request: web.Request) -> web.Response:
    req: ModelRequest = decode_body(await request.read(), ModelRequest)  # type: ignore[assignment]
    router: Router = request.app["router"]
    name = req.model or req.name
    if not name:
        raise bad_request("`model` is required")
    name = _model_name(name, router)
    spec = router.lookup(name)
    rec: EngineRecord | None = request.app["client"].find(name)
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
                                  request.app["started"], timezone.utc).isoformat()})


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
