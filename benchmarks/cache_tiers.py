"""KV cache tiers, side by side in one run on the same model and prompts:

1. time to first token on a miss, a RAM hit and an SSD hit (after a full daemon restart), for
   prompts of several lengths, through `mlxd serve --isolate`; and `mlx_lm.server` on the same
   prompts (its miss and its RAM hit; it has no SSD tier);
2. storage worker throughput (blocks handed over in shared memory, hashed, written, fsynced,
   renamed) against a plain fsync'd sequential write of the same bytes in the same directory;
3. decode tok/s of a running stream while finished requests are written behind, against the
   same traffic with the SSD tier off.

    python benchmarks/cache_tiers.py --model default --lengths 64,256
    python benchmarks/cache_tiers.py --shape small --lengths 256,1024
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import SHAPES, Server, free_port

WORDS = ("lighthouse keeper sea storm harbour ship lantern night rock wave gull tide rope "
         "anchor sail compass map island fog bell").split()


def prompt_of(length_words: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(length_words))


async def ttft(base: str, model: str, text: str) -> tuple[float, int, int]:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    usage = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        async with s.post(base + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: {"):
                    continue
                obj = json.loads(line[6:])
                if first is None and any((c.get("delta") or {}).get("content")
                                         for c in obj.get("choices") or []):
                    first = time.perf_counter() - t0
                if obj.get("usage"):
                    usage = obj["usage"]
    return (first if first is not None else time.perf_counter() - t0,
            usage.get("prompt_tokens", 0),
            (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


def mlxd_server(model: str, run_dir: str, cache_dir: str, ssd: str | None, port: int) -> Server:
    argv = [sys.executable, "-m", "mlxd.cli.main", "serve", model, "--isolate", "--port",
            str(port), "--run-dir", run_dir, "--cache-dir", cache_dir, "--log-level", "warning",
            "--ssd-cache", ssd or "off"]
    return Server(argv, f"http://127.0.0.1:{port}/health")


async def tier_latency(model: str, lengths: list[int], work: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    ssd = str(work / "kv")
    cache_dir = str(work / "cache")
    texts = {n: prompt_of(n, n) for n in lengths}
    port = free_port()
    run_dir = tempfile.mkdtemp(prefix="mlxd-bc-", dir="/tmp")
    srv = mlxd_server(model, run_dir, cache_dir, ssd, port)
    base = f"http://127.0.0.1:{port}"
    try:
        await srv.wait()
        await ttft(base, model, "warm up the kernels")
        for n in lengths:
            miss = await ttft(base, model, texts[n])
            hit = await ttft(base, model, texts[n])
            rows.append({"target": "mlxd", "words": n, "prompt_tokens": miss[1],
                         "miss_s": miss[0], "ram_hit_s": hit[0], "ram_cached": hit[2]})
        async with aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=f"{run_dir}/mlxd.sock")) as s:  # /admin/*
            async with s.post("http://localhost/admin/cache/flush") as r:
                flushed = await r.json()
        print("flushed", flushed, flush=True)
    finally:
        srv.stop()
    srv = mlxd_server(model, tempfile.mkdtemp(prefix="mlxd-bc-", dir="/tmp"), cache_dir, ssd, port)
    try:
        await srv.wait()
        await ttft(base, model, "warm up the kernels")
        for row in rows:
            got = await ttft(base, model, texts[row["words"]])
            row["ssd_hit_s"], row["ssd_cached"] = got[0], got[2]
    finally:
        srv.stop()
    if model != "default":  # mlx_lm.server loads models itself; the GGUF default needs mlxd
        port = free_port()
        srv = Server([sys.executable, "-m", "mlx_lm.server", "--model", model, "--port",
                      str(port), "--log-level", "WARNING"], f"http://127.0.0.1:{port}/health")
        base = f"http://127.0.0.1:{port}"
        try:
            await srv.wait()
            await ttft(base, model, "warm up the kernels")
            for row in rows:
                miss = await ttft(base, model, texts[row["words"]])
                hit = await ttft(base, model, texts[row["words"]])
                row["mlx_lm_miss_s"], row["mlx_lm_hit_s"] = miss[0], hit[0]
        finally:
            srv.stop()
    return rows


def worker_throughput(work: Path, blocks: int, block_bytes: int) -> dict:
    """The storage worker against a plain fsync'd sequential write of the same bytes."""
    import zmq

    from mlxd.protocol import codec, shm
    from mlxd.protocol.addresses import Endpoints
    from mlxd.protocol.block_format import Layout, namespace_key
    from mlxd.protocol.messages import BlockWrite, StoreBlocks, StoreDone

    run_dir = Path(tempfile.mkdtemp(prefix="mlxd-bw-", dir="/tmp"))
    root = work / "worker-kv"
    from mlxd.daemon.launch import popen
    from mlxd.protocol.settings import StorageLaunch, StorageSettings
    proc = popen(StorageLaunch(epoch=0, run_dir=str(run_dir), log_level="warning",
                               root=str(root), supervised=False, settings=StorageSettings()))
    kv_heads, head_dim, layers = 8, 64, 1
    tokens_per_block = block_bytes // (layers * kv_heads * 2 * head_dim * 4)
    real_block = layers * kv_heads * tokens_per_block * 2 * head_dim * 4
    slots = 16
    name = shm.segment_name(run_dir, "bench", 0)
    seg = shm.create(run_dir, name, real_block * slots)
    buf = seg.buf
    assert buf is not None
    import numpy as np
    np.frombuffer(buf, dtype=np.uint8)[:] = np.random.default_rng(0).integers(
        0, 255, real_block * slots, dtype=np.uint8)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(Endpoints.ipc(run_dir).storage)
    enc, dec = codec.to_storage(), codec.from_storage()
    ns = namespace_key("bench")
    free = list(range(slots))
    sent = done = 0
    t0 = time.perf_counter()
    while done < blocks:
        while free and sent < blocks:
            slot = free.pop()
            key = sent.to_bytes(32, "little")
            sock.send(enc.encode(StoreBlocks("bench", 0, name, real_block, ns,
                                             Layout(layers, kv_heads, head_dim, head_dim,
                                                    "float32"),
                                             [BlockWrite(slot, ns, key,
                                                         list(range(tokens_per_block)))])))
            sent += 1
        reply = dec.decode(sock.recv())
        assert isinstance(reply, StoreDone), reply
        free.extend(reply.slots)
        done += len(reply.slots)
    worker_s = time.perf_counter() - t0
    sock.close()  # the worker serves a connected engine for a while after SIGTERM
    proc.terminate()
    proc.wait()
    # the reference: one file, sequential writes of the same bytes, fsync at the end
    ref = work / "plain.bin"
    payload = bytes(buf[:real_block])
    t0 = time.perf_counter()
    fd = os.open(ref, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for _ in range(blocks):
        os.write(fd, payload)
    os.fsync(fd)
    os.close(fd)
    plain_s = time.perf_counter() - t0
    seg.close()
    shm.unlink(name)
    ctx.term()
    total = blocks * real_block
    return {"blocks": blocks, "block_bytes": real_block, "worker_MBps": total / worker_s / 1e6,
            "plain_fsync_MBps": total / plain_s / 1e6, "ratio": plain_s / worker_s}


async def decode_while_writing(model: str, work: Path, stream_tokens: int,
                               side_requests: int) -> dict:
    """One long stream's decode rate while short requests finish (and, with the SSD tier on,
    are written behind), against the same traffic with the tier off."""
    rates: dict[str, float] = {}
    for label, ssd in (("ssd_off", None), ("ssd_on", str(work / "kv-dw"))):
        port = free_port()
        srv = mlxd_server(model, tempfile.mkdtemp(prefix="mlxd-bd-", dir="/tmp"),
                          str(work / "cache"), ssd, port)
        base = f"http://127.0.0.1:{port}"
        try:
            await srv.wait()
            await ttft(base, model, "warm up")
            gaps: list[float] = []

            async def long_stream(base: str, gaps: list[float]) -> None:
                body = {"model": model, "max_tokens": stream_tokens, "stream": True,
                        "messages": [{"role": "user", "content": "Tell a long story."}]}
                last = None
                async with aiohttp.ClientSession() as s:
                    async with s.post(base + "/v1/chat/completions", json=body) as r:
                        async for raw in r.content:
                            if b'"content": "' in raw:
                                now = time.perf_counter()
                                if last is not None:
                                    gaps.append(now - last)
                                last = now

            async def side(base: str) -> None:
                for i in range(side_requests):
                    await ttft(base, model, prompt_of(40, 1000 + i))

            await asyncio.gather(long_stream(base, gaps), side(base))
            rates[label] = 1 / statistics.mean(gaps) if gaps else 0.0
        finally:
            srv.stop()
    return {**{label: {"decode_tok_s": rate} for label, rate in rates.items()},
            "slowdown": 1 - rates["ssd_on"] / rates["ssd_off"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    ap.add_argument("--lengths", default="64,256", help="prompt lengths in words")
    ap.add_argument("--worker-blocks", type=int, default=64)
    ap.add_argument("--block-mb", type=float, default=4.0)
    ap.add_argument("--stream-tokens", type=int, default=64)
    ap.add_argument("--side-requests", type=int, default=6)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cache_tiers"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mlxd-bench-"))
    model = args.model
    if model is None:
        from throughput import model_for
        ns = argparse.Namespace(model=None, shape=args.shape, model_dtype="float32")
        model = model_for(ns)
    lengths = [int(x) for x in args.lengths.split(",")]
    result = {"model": args.model or f"random {args.shape}",
              "tiers": asyncio.run(tier_latency(model, lengths, work)),
              "worker": worker_throughput(work, args.worker_blocks, int(args.block_mb * 2**20)),
              "decode_while_writing": asyncio.run(decode_while_writing(
                  model, work, args.stream_tokens, args.side_requests))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
