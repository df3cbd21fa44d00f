"""Ollama's `POST /api/pull` (runs in the proxy). Clients (Open WebUI and others) call it
before using a model, present or not: a model that loads without fetching anything (a local
directory, a repo in the Hugging Face cache, the default model) succeeds at once; a repo id
that is not cached is fetched from the Hub, file by file, the files mlx-lm's load would fetch,
with Ollama-shaped progress lines (`pulling <file>`, `total`, `completed`) while streaming. A
name that is neither (offline, no such repo, no such directory) is a 404 before any line.
Progress is per file: a file's `completed` moves when it is done."""

from __future__ import annotations

import asyncio
import fnmatch
import json

from aiohttp import web

from mlxd.proxy.bounds import clip, decode_body
from mlxd.proxy.dialects.ollama.schema import PullRequest, served_name
from mlxd.proxy.errors import APIError, bad_request
from mlxd.proxy.state import STATE

# What mlx_lm.utils._download fetches (DEFAULT_ALLOW_PATTERNS, mlx-lm 0.32): nothing more is
# needed to load the model, and the proxy does not import mlx-lm to ask it.
ALLOW_PATTERNS = ("*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken",
                  "tiktoken.model", "*.txt", "*.jsonl", "*.jinja")
TICK_S = 1.0  # a progress line at least this often while a file downloads


def _line(obj: dict) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def _not_pulled(name: str, why: str) -> APIError:
    return APIError(404, f"pull model manifest: {clip(name)}: {why}", code="model_not_found",
                    param="model")


def _files(repo: str) -> list[tuple[str, int]]:
    """The repo's files a load needs, with their sizes (blocking: a worker thread)."""
    from huggingface_hub import HfApi
    info = HfApi().model_info(repo, files_metadata=True)
    files = [(s.rfilename, s.size or 0) for s in info.siblings or ()
             if any(fnmatch.fnmatch(s.rfilename, p) for p in ALLOW_PATTERNS)]
    # config.json last: a repo counts as present once it is cached, so a pull cut short
    # before the end leaves one that is not present, and the next pull goes on with it
    return sorted(files, key=lambda f: f[0] == "config.json")


def _hub_download(repo: str, filename: str) -> None:
    from huggingface_hub import hf_hub_download
    hf_hub_download(repo, filename)


async def pull(request: web.Request) -> web.StreamResponse:
    req = decode_body(await request.read(), PullRequest)
    state = request.app[STATE]
    name = req.model or req.name
    if not name:
        raise bad_request("`model` is required", param="model")
    name = served_name(name, state.router)
    try:
        spec = state.router.lookup(name)
    except APIError as e:
        raise _not_pulled(name, e.message) from None
    loadable = state.router.loadable
    stream = req.stream is not False
    if await loadable.present(spec):
        if not stream:
            return web.json_response({"status": "success"})
        return await _respond(request, [{"status": "pulling manifest"},
                                        {"status": "verifying sha256 digest"},
                                        {"status": "writing manifest"}, {"status": "success"}])
    problem = await loadable.problem(spec)
    if problem is not None:
        raise _not_pulled(name, problem)
    try:
        files = await asyncio.to_thread(_files, spec)
    except Exception as e:  # noqa: BLE001 - the Hub went away since it was asked
        raise _not_pulled(name, f"the Hugging Face Hub could not list it "
                                f"({type(e).__name__})") from None
    if not stream:
        for filename, _ in files:
            await _fetch(spec, filename)
        return web.json_response({"status": "success"})
    return await _stream_fetch(request, spec, files)


async def _respond(request: web.Request, lines: list[dict]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    await resp.write(b"".join(_line(x) for x in lines))
    await resp.write_eof()
    return resp


async def _fetch(repo: str, filename: str) -> None:
    try:
        await asyncio.to_thread(_hub_download, repo, filename)
    except Exception as e:  # noqa: BLE001 - network, disk: the client is told, not the log
        raise APIError(500, f"pull model: {clip(filename)} could not be fetched "
                            f"({type(e).__name__})", type="server_error",
                       code="pull_failed") from None


async def _stream_fetch(request: web.Request, repo: str, files: list[tuple[str, int]]
                        ) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    await resp.write(_line({"status": "pulling manifest"}))
    try:
        for filename, size in files:
            status = {"status": f"pulling {filename}", "digest": filename, "total": size}
            task = asyncio.ensure_future(_fetch(repo, filename))
            try:
                while not task.done():
                    await resp.write(_line({**status, "completed": 0}))
                    await asyncio.wait([task], timeout=TICK_S)
            finally:  # a client gone mid-file: the file is still fetched, its outcome dropped
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
            task.result()
            await resp.write(_line({**status, "completed": size}))
        await resp.write(b"".join(_line({"status": s}) for s in (
            "verifying sha256 digest", "writing manifest", "success")))
    except APIError as e:  # mid-stream: Ollama's one {"error": ...} line
        await resp.write(_line(e.body("ollama")))
    await resp.write_eof()
    return resp
