"""The engine's write-behind into shared memory (engine/ssd_tier.py), without a storage worker:
a block's slot holds, layer after layer, its span of the keys then the values (each
(kv_heads, tokens, width) in C order; quantized, each triplet part in turn), the layout the
storage worker writes and `ssd_restore` reads, read from the entry's arrays as they are (views
of a longer cache, bfloat16) or, where the host may not read device memory (CUDA), gathered on
the device into one staging array first; both ways are run here."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import zmq

from mlxd.engine.kv.prefix_cache import Entry
from mlxd.engine.kv.ssd_tier import SsdTier
from mlxd.protocol.block_format import Layout
from mlxd.protocol.messages import StoreBlocks

BLOCK = 16


def _tier(tmp_path: Path, layout: Layout, ctx: zmq.Context, staging: str = "views") -> SsdTier:
    return SsdTier(root=tmp_path / "kv", layout=layout, description=f"test {layout}",
                   block_tokens=BLOCK, run_dir=tmp_path, engine_id="t", epoch=0, slots=8,
                   verify=False, ctx=ctx, endpoint=f"ipc://{tmp_path}/nobody",
                   device_staging=staging == "device")


def _copied(tier: SsdTier, entries: list[Entry]) -> tuple[int, StoreBlocks]:
    """Persist `entries`; the storage thread's StoreBlocks once it has copied them."""
    done = threading.Event()
    got: list[StoreBlocks] = []
    copy = tier._copy

    def watched(blocks: list) -> StoreBlocks:
        got.append(copy(blocks))
        done.set()
        return got[-1]
    tier._copy = watched  # type: ignore[method-assign]
    queued = tier.persist_all(entries)
    assert done.wait(30), "the storage thread never copied the blocks"
    return queued, got[0]


def _bytes(a: mx.array) -> bytes:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.asarray(a)).tobytes()


def _expected(layers: list[tuple[Any, Any]], start: int, end: int) -> bytes:
    parts = [a for k, v in layers
             for a in ((*k, *v) if isinstance(k, tuple) else (k, v))]
    return b"".join(_bytes(a[0, :, start:end, :]) for a in parts)


def _held(tier: SsdTier, slot: int, n: int) -> bytes:
    off = slot * tier.slot_bytes
    buf = tier._shm.buf
    assert buf is not None
    with buf[off:off + n] as view:  # released before the segment closes
        return bytes(view)


STAGINGS = ["views", "device"]


@pytest.mark.parametrize("staging", STAGINGS)
@pytest.mark.parametrize("bits", [0, 4])
def test_each_slot_holds_its_blocks_span_of_every_layer(tmp_path, bits, staging):
    ctx = zmq.Context()
    heads, dim, tokens = 2, 64, 24  # a full block and a tail of 8
    layout = Layout(2, heads, dim, dim, "bfloat16", bits, 64 if bits else 0)
    tier = _tier(tmp_path, layout, ctx, staging)
    assert tier.device_staging == (staging == "device")
    try:
        layers: list[tuple[Any, Any]] = []
        for _ in range(2):  # views of a longer cache, as a finished row's are
            k, v = (mx.random.normal((1, heads, 40, dim)).astype(mx.bfloat16)
                    for _ in range(2))
            if bits:
                layers.append((tuple(x[..., :tokens, :] for x in mx.quantize(k, 64, bits)),
                               tuple(x[..., :tokens, :] for x in mx.quantize(v, 64, bits))))
            else:
                layers.append((k[..., :tokens, :], v[..., :tokens, :]))
        entry = Entry(tuple(range(100, 100 + tokens)), layers, 0)
        queued, msg = _copied(tier, [entry])
        assert queued == 2 and entry.persisted
        spans = {len(w.tokens): w for w in msg.blocks}
        assert sorted(spans) == [8, BLOCK] and spans[8].tail and not spans[BLOCK].tail
        for n, start in ((BLOCK, 0), (8, BLOCK)):
            want = _expected(layers, start, start + n)
            assert len(want) == layout.payload_bytes(n)
            assert _held(tier, spans[n].slot, len(want)) == want
    finally:
        tier.close()
        ctx.term()


@pytest.mark.parametrize("staging", STAGINGS)
def test_entries_of_one_step_are_queued_together_and_known_blocks_are_not(tmp_path, staging):
    """Several entries in one call, each block's bytes in its own slot; a longer entry whose
    first block is already queued sends only the rest (on the device: only that span)."""
    ctx = zmq.Context()
    layout = Layout(2, 1, 8, 8, "float32")
    tier = _tier(tmp_path, layout, ctx, staging)
    try:
        def entry(first: int, n: int) -> Entry:
            kv = mx.arange(40 * 8, dtype=mx.float32).reshape(1, 1, 40, 8) + first
            return Entry(tuple(range(first, first + n)),
                         [(kv[..., :n, :], kv[..., :n, :] + 0.5),
                          (kv[..., :n, :] * 2, kv[..., :n, :] - 3)], 0)

        def check(writes: list, e: Entry) -> None:
            for w in writes:
                start = w.tokens[0] - e.tokens[0]
                want = _expected(e.layers, start, start + len(w.tokens))
                assert _held(tier, w.slot, len(want)) == want
        a, b = entry(0, 20), entry(1000, 5)
        queued, msg = _copied(tier, [a, b])
        assert queued == 3 and len(msg.blocks) == 3  # a: block + tail; b: a tail
        check(msg.blocks[:2], a)
        check(msg.blocks[2:], b)
        assert tier.persist_all([a]) == 0  # already queued: nothing again
        longer = entry(0, 40)  # its first block is a's: queued already
        queued, msg = _copied(tier, [longer])
        assert queued == 2 and [len(w.tokens) for w in msg.blocks] == [BLOCK, 8]
        check(msg.blocks, longer)
    finally:
        tier.close()
        ctx.term()


def test_a_staging_failure_fails_its_blocks_not_the_step(tmp_path, monkeypatch):
    """The device may run out of memory while it gathers blocks: the MLX thread goes on, the
    slots come back, the tier backs off, and the entry stays marked as not on disk."""
    ctx = zmq.Context()
    tier = _tier(tmp_path, Layout(1, 1, 8, 8, "float32"), ctx, "device")
    try:
        def out_of_memory(blocks: list) -> Any:
            raise RuntimeError("[malloc_async] Unable to allocate 4194304 bytes.")
        monkeypatch.setattr(tier, "_stage_on_device", out_of_memory)
        kv = mx.zeros((1, 1, 20, 8))
        entry = Entry(tuple(range(20)), [(kv, kv)], 0)
        assert tier.persist_all([entry]) == 0
        assert not entry.persisted and tier._free.qsize() == 8 and not tier._pending
        assert tier.stats.write_failures == 2 and tier.health.refusal is not None
        assert tier.health.refusal.code == "copy_failed"
    finally:
        tier.close()
        ctx.term()


def test_a_tail_the_worker_confirms_is_indexed_and_one_it_fails_is_not(tmp_path):
    """The tail index (engine/tail_index.py) learns the engine's own tails from the storage
    worker's answers; here a ROUTER on the tier's endpoint answers as the worker would."""
    from mlxd.protocol import codec
    from mlxd.protocol.block_format import block_key
    from mlxd.protocol.messages import StoreDone
    ctx = zmq.Context()
    worker = ctx.socket(zmq.ROUTER)
    worker.bind(f"ipc://{tmp_path}/worker")
    tier = SsdTier(root=tmp_path / "kv", layout=Layout(1, 1, 8, 8, "float32"),
                   description="test tails", block_tokens=BLOCK, run_dir=tmp_path, engine_id="t",
                   epoch=0, slots=8, verify=False, ctx=ctx, endpoint=f"ipc://{tmp_path}/worker")
    dec, enc = codec.to_storage(), codec.from_storage()
    try:
        assert tier.tails.ready.wait(10)
        kv = mx.zeros((1, 1, 40, 8))

        def answer(tokens: tuple[int, ...], failed: bool) -> None:
            tier.persist_all([Entry(tokens, [(kv, kv)], 0)])
            assert worker.poll(10_000), "no StoreBlocks"
            ident, raw = worker.recv_multipart()
            msg = dec.decode(raw)
            assert isinstance(msg, StoreBlocks)
            n = len(msg.blocks)
            done = StoreDone([b.slot for b in msg.blocks], written=0 if failed else n,
                             failed=n if failed else 0, error_code="io_error" if failed else None,
                             error="refused" if failed else None)
            with tier._idle:
                worker.send_multipart([ident, enc.encode(done)])
                assert tier._idle.wait_for(lambda: not tier._pending, 10)

        written = tuple(range(100, 120))  # a full block and a 4-token tail after it
        answer(written, failed=False)
        after = block_key(tier.namespace, list(written[:BLOCK]))
        assert tier.tails.best(after, list(written[BLOCK:]) + [7]) == \
            (4, block_key(after, list(written[BLOCK:])))
        assert tier.tails.count == 1  # the full block is not a tail
        tier.health.retry_now(0.0)
        refused = tuple(range(200, 205))
        answer(refused, failed=True)
        assert tier.tails.best(tier.namespace, list(refused)) is None
        assert tier.tails.count == 1
    finally:
        tier.close()
        worker.close(0)
        ctx.term()


def test_blocks_are_gathered_on_the_device_by_default_only_on_cuda(monkeypatch):
    """`ssd_staging` auto: on CUDA a host read would move a live cache's buffer to managed
    memory (decode steps stalled by it), so blocks are gathered on the device there; with
    unified memory (Metal, the CPU backend) the arrays are read as they are. An explicit
    setting wins everywhere."""
    from mlxd.engine.kv import ssd_tier
    from mlxd.protocol.settings import TuningSettings
    assert TuningSettings().ssd_staging == "auto"
    assert not ssd_tier.stages_on_device("auto", mx.cpu)
    assert not ssd_tier.stages_on_device("auto", mx.gpu) or mx.cuda.is_available()
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert ssd_tier.stages_on_device("auto", mx.gpu)
    assert not ssd_tier.stages_on_device("auto", mx.cpu)
    assert not ssd_tier.stages_on_device("views", mx.gpu)
    assert ssd_tier.stages_on_device("device", mx.cpu)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    assert not ssd_tier.stages_on_device("auto", mx.gpu)  # Metal
