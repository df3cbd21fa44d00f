"""KV cache quantization (--kv-bits): the batched quantized cache against mlx-lm's own
QuantizedKVCache, rows of different lengths (joining and leaving) against each row alone, the
RAM prefix cache and the SSD tier with quantized KV, and blocks of other bits refused (the
header check, the engine's reader, and through real daemons)."""

from __future__ import annotations

import queue

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import QuantizedKVCache
from mlx_lm.sample_utils import greedy_sampler

from conftest import start_daemon
from conftest import stop_and_check as stop
from mlxd.engine.batch.messages import AddRequest
from mlxd.engine.batch.runner import Runner
from mlxd.engine.kv import quant as kv_quant
from mlxd.engine.kv.ssd_restore import SsdReader
from mlxd.engine.kv.ssd_tier import SsdStats
from mlxd.engine.load.loader import load_model
from mlxd.protocol.block_format import (
    BadBlock,
    Layout,
    block_key,
    block_path,
    namespace_key,
    pack_header,
    read_block,
)
from support.harness import stream_chat
from support.random_model import write_random_model
from support.runner_drive import run_one


@pytest.fixture(scope="module")
def qmodel(tmp_path_factory):
    """A tiny random Llama whose head size (64) takes the default group size."""
    path = write_random_model(tmp_path_factory.mktemp("models") / "tiny-64", hidden=256,
                              heads=4, kv_heads=2, intermediate=256, layers=2)  # head size 64
    m, tok, _ = load_model(str(path), tmp_path_factory.mktemp("c"))
    yield path, m, tok
    kv_quant.uninstall(m)


def reference(m, prompt, bits, n):
    """mlx-lm's own single-sequence generation with its QuantizedKVCache from token one."""
    kv_quant.uninstall(m)
    cache = [QuantizedKVCache(64, bits) for _ in m.layers]
    return [int(t) for t, _ in generate_step(mx.array(prompt), m, max_tokens=n,
                                             prompt_cache=cache)]


def batched(m, prompts, bits, n, late=None, drop_first=False):
    """Greedy tokens per prompt through mlx-lm's BatchGenerator on quantized rows, in the
    order inserted; `late` (a prompt) joins after three steps; with `drop_first` the first row
    is removed after five (and left out of the answer)."""
    kv_quant.install(m, bits, 64)
    gen = BatchGenerator(m, completion_batch_size=8, prefill_batch_size=8)
    try:
        uids = gen.insert(prompts, max_tokens=[n] * len(prompts))
        got: dict[int, list[int]] = {u: [] for u in uids}
        steps = 0
        while True:
            _, rs = gen.next()
            steps += 1
            for r in rs:
                got[r.uid].append(r.token)
            if late is not None and steps == 3:
                got[gen.insert([late], max_tokens=[n])[0]] = []
                late = None
            if drop_first and steps == 5:
                assert len(got[uids[0]]) < n
                gen.remove([uids[0]])
                del got[uids[0]]
            if steps > 5 and all(len(v) == n for v in got.values()):
                return [got[u] for u in sorted(got)]
    finally:
        gen.close()


@pytest.mark.parametrize("bits", [8, 4])
def test_one_row_equals_mlx_lm_quantized_cache(qmodel, bits):
    _, m, _ = qmodel
    prompt = list(range(5, 30))
    ref = reference(m, prompt, bits, 12)
    kv_quant.install(m, bits, 64)
    gen = BatchGenerator(m, completion_batch_size=4, prefill_batch_size=4)
    try:
        uid = gen.insert([prompt], max_tokens=[12])[0]
        out: list[int] = []
        while len(out) < 12:
            out += [r.token for r in gen.next()[1] if r.uid == uid]
    finally:
        gen.close()
    if bits == 8:
        assert out == ref
    else:  # 4 bits: the same kernels, but allow rounding to part the ways after a while
        assert out[:4] == ref[:4]


def test_rows_of_different_lengths_equal_each_alone(qmodel):
    _, m, _ = qmodel
    prompts = [list(range(3, 3 + n)) for n in (40, 7, 300)]  # 300: more than one 256 step
    late = list(range(50, 70))
    alone = {i: batched(m, [p], 8, 10)[0] for i, p in enumerate([*prompts, late])}
    # rows 1, 2 and the late one run to the end in a batch whose members come and go
    got = batched(m, prompts, 8, 10, late=late, drop_first=True)
    assert got == [alone[1], alone[2], alone[3]]


def test_quantized_cache_is_smaller_and_install_refuses_what_it_cannot_do(qmodel, tiny_model,
                                                                          tmp_path):
    _, m, _ = qmodel
    from mlxd.engine.batch.sizing import kv_shape
    stream = mx.default_stream(mx.default_device())
    kv_quant.uninstall(m)
    plain = kv_shape(m, stream).bytes_per_token
    kv_quant.install(m, 4, 64)
    q4 = kv_shape(m, stream).bytes_per_token
    kv_quant.install(m, 8, 64)
    q8 = kv_shape(m, stream).bytes_per_token
    # float32 KV: 4 bits + a float32 scale and bias per 64 = 0.625 of 4 bytes
    assert q4 / plain == pytest.approx(0.625 / 4) and q8 / plain == pytest.approx(1.125 / 4)
    small, _, _ = load_model(str(tiny_model), tmp_path)  # head size 16: no group divides it
    with pytest.raises(kv_quant.KvQuantError, match="does not divide"):
        kv_quant.install(small, 4, 32)
    with pytest.raises(kv_quant.KvQuantError, match="must be one of"):
        kv_quant.install(small, 3, 64)



def test_ram_prefix_cache_holds_quantized_kv(qmodel):
    _, m, tok = qmodel
    kv_quant.install(m, 4, 64)
    outq: queue.Queue = queue.Queue()
    r = Runner(m, [], batch_size=4, prefill_step=64, outbox=outq, cache_bytes=1 << 30)
    prompt = tok.encode("Hello, how are you today? The quick brown fox")
    gen1, s1 = run_one(r, outq, AddRequest("a", prompt, 8, greedy_sampler, []))
    assert s1.cached_tokens == 0
    entry = r.cache.entries()[0]
    assert isinstance(entry.layers[0][0], tuple) and entry.layers[0][0][0].dtype == mx.uint32
    gen2, s2 = run_one(r, outq, AddRequest("b", prompt, 8, greedy_sampler, []))
    assert s2.source == "ram" and s2.cached_tokens == len(prompt) - 1 and gen2 == gen1
    follow = prompt + gen1 + tok.encode(" and then")
    gen3, s3 = run_one(r, outq, AddRequest("c", follow, 5, greedy_sampler, []))
    assert s3.cached_tokens == len(prompt) + len(gen1)
    cold = Runner(m, [], batch_size=4, prefill_step=64, outbox=outq, cache_bytes=0)
    assert run_one(cold, outq, AddRequest("d", follow, 5, greedy_sampler, []))[0] == gen3


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_next"])
def test_a_mixed_models_plain_kv_layers_are_quantized_and_its_hits_exact(family, tmp_path):
    """--kv-bits on a model with sliding-window or recurrent layers quantizes its plain KV
    layers only; its RAM tier hits give the text of a cold run of the same quantized model."""
    path = write_random_model(tmp_path / family, family=family, hidden=128, heads=2,
                              kv_heads=1)  # head size 64
    m, _, _ = load_model(str(path), tmp_path / "c")
    kv_quant.install(m, 8, 64)
    kinds = [type(c).__name__ for c in m.make_cache()]
    assert "QuantizedRowCache" in kinds and "KVCache" not in kinds
    assert {"RotatingKVCache", "ArraysCache"} & set(kinds)
    outq: queue.Queue = queue.Queue()
    r = Runner(m, [], batch_size=4, prefill_step=32, outbox=outq, cache_bytes=1 << 30)
    prompt = [5 + (i * 37) % 290 for i in range(90)]
    gen1, _ = run_one(r, outq, AddRequest("a", prompt, 8, greedy_sampler, []))
    gen2, s2 = run_one(r, outq, AddRequest("b", prompt, 8, greedy_sampler, []))
    assert s2.cached_tokens == len(prompt) - 1 and gen2 == gen1
    follow = prompt + gen1 + [7, 8, 9]
    gen3, s3 = run_one(r, outq, AddRequest("c", follow, 5, greedy_sampler, []))
    assert s3.cached_tokens == len(prompt) + len(gen1)
    cold = Runner(m, [], batch_size=4, prefill_step=32, outbox=outq, cache_bytes=0)
    assert run_one(cold, outq, AddRequest("d", follow, 5, greedy_sampler, []))[0] == gen3


def test_kv_bits_refuses_attention_sinks_in_one_line(tmp_path):
    path = write_random_model(tmp_path / "oss", family="gpt_oss", hidden=128, heads=2,
                              kv_heads=1)
    m, _, _ = load_model(str(path), tmp_path / "c")
    with pytest.raises(kv_quant.KvQuantError, match="no quantized attention"):
        kv_quant.install(m, 8, 64)
    assert "make_cache" not in m.__dict__  # left as it was


# ---------------------------------------------------------------------- block header and key

L8 = Layout(2, 2, 64, 64, "float32", 8, 64)
L4 = Layout(2, 2, 64, 64, "float32", 4, 64)
L0 = Layout(2, 2, 64, 64, "float32")


def write_block(root, layout, tokens, ns=b"n" * 32):
    parent = ns
    key = block_key(parent, tokens)
    payload = np.random.default_rng(0).integers(0, 255, layout.payload_bytes(len(tokens)),
                                                dtype=np.uint8).tobytes()
    import blake3
    path = block_path(root, parent, len(tokens), key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pack_header(layout, ns, parent, key, tokens,
                                 blake3.blake3(payload).digest(), len(payload), True) + payload)
    return path, parent, key, payload


def test_block_header_records_bits_and_a_reader_with_other_bits_refuses(tmp_path):
    tokens = [1, 2, 3]
    path, parent, key, payload = write_block(tmp_path, L8, tokens)
    assert bytes(read_block(path, L8, b"n" * 32, parent, key, tokens)) == payload
    for other in (L4, L0, Layout(2, 2, 64, 64, "float32", 8, 32)):
        with pytest.raises(BadBlock, match="quantization mismatch|size mismatch"):
            read_block(path, other, b"n" * 32, parent, key, tokens)
    # 8 bits + float32 scale and bias per 64 elements: 1.125 bytes an element, 4 bits 0.625
    assert L8.payload_bytes(16) / L0.payload_bytes(16) == pytest.approx(1.125 / 4)
    assert L4.payload_bytes(16) / L0.payload_bytes(16) == pytest.approx(0.625 / 4)
    # an unquantized layout is named as before the bits existed (its namespaces are unchanged)
    assert "kv_bits" not in repr(L0) and "kv_bits=8" in repr(L8)
    assert namespace_key(f"x|{L8}") != namespace_key(f"x|{L4}") != namespace_key(f"x|{L0}")


def test_engine_reader_with_other_bits_is_a_miss(tmp_path):
    ns = b"n" * 32
    tokens = list(range(8))
    write_block(tmp_path, L8, tokens[:4], ns=ns)
    prompt = tokens[:4] + [99]
    stats = SsdStats()
    ok = SsdReader(ns, tmp_path, L8, 16, True, stats, lambda names: None)
    got = ok.better_than_ram(prompt, 0)
    assert got is not None and got.tokens == 4 and len(got.layers[0][0]) == 3
    k = got.layers[0][0]
    assert k[0].dtype == np.uint32 and k[0].shape == (1, 2, 4, 64 * 8 // 32)
    assert k[1].shape == (1, 2, 4, 1)
    stats = SsdStats()
    wrong = SsdReader(ns, tmp_path, L4, 16, True, stats, lambda names: None)
    assert wrong.better_than_ram(prompt, 0) is None and stats.bad_blocks == 1


# ---------------------------------------------------------------------- through daemons

SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 3}


def chat(d, user, max_tokens=8):
    with d.http() as c:
        r = c.post("/v1/chat/completions", json={
            "messages": [SYSTEM, {"role": "user", "content": user}], "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], \
        body["usage"]["prompt_tokens_details"]["cached_tokens"], body["usage"]["prompt_tokens"]


def serve(model, ssd, *extra, **kw):
    return start_daemon(model, "--ssd-cache", str(ssd), "--block-tokens", "16", *extra, **kw)


def test_ssd_round_trip_resume_and_blocks_of_other_bits_are_misses(qmodel, tmp_path):
    path = qmodel[0]
    ssd = tmp_path / "kv"
    ask = "Tell me about the sea and the lighthouse."
    d = serve(path, tmp_path / "fresh", "--kv-bits", "4")
    try:  # the 4-bit answer computed from nothing, for the miss below
        fresh4, cached, _ = chat(d, ask)
        assert cached == 0
    finally:
        stop(d)
    # --isolate, 8 bits, checkpoints: a killed engine's request resumes from quantized blocks
    d = serve(path, ssd, "--kv-bits", "8", "--generation-checkpoint", "8", "--restart-backoff",
              "0.1", isolate=True, env={"MLXD_FAULTS": "engine.step=delay@1#<2"})
    try:
        text8, cached, _ = chat(d, ask, max_tokens=24)
        body = {"messages": [SYSTEM, {"role": "user", "content": ask}], "max_tokens": 24}
        resumed, usage = stream_chat(d, body, kill_after=12)
        assert resumed == text8 and usage["resumes"] == 1
        assert d.stats()["engines"][0]["cache"]["ssd_hits"] >= 1  # the restarted engine's
        with d.unix_http() as c:
            assert c.post("/admin/cache/flush").json()["failed"] == 0
    finally:
        stop(d)
    blocks = sorted(ssd.rglob("*.blk"))
    assert blocks and all(b.read_bytes()[33] == 8 for b in blocks)  # the header's bits
    d = serve(path, ssd, "--kv-bits", "8")
    try:  # a restart: the SSD tier restores the quantized blocks, the text is the same
        restored, cached, prompt = chat(d, ask, max_tokens=24)
        assert cached == prompt - 1 and restored == text8
        assert d.stats()["engines"][0]["cache"]["ssd_hits"] == 1
    finally:
        stop(d)
    d = serve(path, ssd, "--kv-bits", "4")
    try:  # other bits: nothing found (another namespace), the answer computed anew
        text4, cached, _ = chat(d, ask)
        c = d.stats()["engines"][0]["cache"]
        assert cached == 0 and c["ssd_hits"] == 0 and c["ssd_bad_blocks"] == 0
        assert text4 == fresh4
    finally:
        stop(d)
    d = serve(path, ssd)
    try:  # unquantized: a miss too
        _, cached, _ = chat(d, ask)
        assert cached == 0 and d.stats()["engines"][0]["cache"]["ssd_hits"] == 0
    finally:
        stop(d)
