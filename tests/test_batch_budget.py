"""`--batch auto` sizing (engine/batch_budget.py): pure logic from memory figures."""

from __future__ import annotations

from mlxd.engine.batch_budget import (
    CEILING,
    KvShape,
    budget,
    ceiling,
    current_cap,
    explain,
    explicit_cap,
    may_admit,
    reserved_tokens,
)

GiB = 2**30
LLAMA_1B = KvShape(layers=16, kv_heads=8, k_head_dim=64, v_head_dim=64, bytes_per_element=2)


def test_bytes_per_token_of_a_1b_llama():
    assert LLAMA_1B.bytes_per_token == 16 * 8 * 128 * 2 == 32768


def test_budget_takes_weights_and_a_reserve_off_the_top():
    b = budget(10 * GiB, 2 * GiB, LLAMA_1B, None, "test")
    assert b.kv_bytes == int(10 * GiB * 0.9) - 2 * GiB
    assert b.kv_tokens == b.kv_bytes // 32768
    assert "GiB" in b.why and "KiB/token" in b.why


def test_a_small_machine_admits_fewer_long_requests_than_short_ones():
    b = budget(4 * GiB, 3 * GiB, LLAMA_1B, None, "test")  # about 0.6 GiB: ~19k tokens
    long_req = reserved_tokens(8000, 512, 32768)
    short_req = reserved_tokens(200, 100, 32768)
    assert may_admit(b, 1, long_req, long_req) and not may_admit(b, 2, 2 * long_req, long_req)
    assert may_admit(b, 30, 30 * short_req, short_req)
    assert current_cap(b, 0, 0, long_req) < current_cap(b, 0, 0, short_req)


def test_nothing_running_always_admits_one():
    b = budget(1 * GiB, 2 * GiB, LLAMA_1B, None, "test")  # no room at all
    assert b.kv_tokens == 0
    assert may_admit(b, 0, 0, 10_000) and not may_admit(b, 1, 10_000, 10)


def test_the_ceiling_and_an_explicit_cap():
    big = budget(1000 * GiB, 1 * GiB, LLAMA_1B, None, "test")
    assert may_admit(big, CEILING - 1, 0, 10) and not may_admit(big, CEILING, 0, 10)
    assert current_cap(big, 0, 0, 100) == CEILING
    capped = budget(1000 * GiB, 1 * GiB, LLAMA_1B, 8, "test")
    assert may_admit(capped, 7, 0, 10) and not may_admit(capped, 8, 0, 10)
    assert current_cap(capped, 0, 0, 100) == 8


def test_reserved_tokens_stop_at_the_context():
    assert reserved_tokens(100, 50, 1000) == 150
    assert reserved_tokens(900, 512, 1000) == 1000


def test_the_prefix_cache_capacity_comes_off_the_budget():
    without = budget(10 * GiB, 2 * GiB, LLAMA_1B, None, "test")
    with_cache = budget(10 * GiB, 2 * GiB, LLAMA_1B, None, "test", cache_bytes=4 * GiB)
    assert without.kv_bytes - with_cache.kv_bytes == 4 * GiB
    assert "prefix cache 4.0 GiB" in with_cache.why and "prefix cache" not in without.why


def test_the_setting_gives_the_cap_and_the_generator_ceiling():
    assert (explicit_cap("auto"), ceiling("auto")) == (None, CEILING)
    assert (explicit_cap(16), ceiling(16)) == (16, 16)


def test_explain_names_the_bound_that_holds():
    roomy = budget(1000 * GiB, 1 * GiB, LLAMA_1B, None, "GPU memory")
    cap, why = explain(roomy, 0, 0, 300)
    assert cap == CEILING and why.startswith("the ceiling (128)") and "GPU memory" in why
    cap, why = explain(budget(1000 * GiB, 1 * GiB, LLAMA_1B, 16, "x"), 3, 900, 300)
    assert cap == 16 and why.startswith("--batch 16")
    small = budget(4 * GiB, 3 * GiB, LLAMA_1B, None, "RAM")  # ~19k tokens
    cap, why = explain(small, 2, 16_000, 1000)
    assert cap == 2 + (small.kv_tokens - 16_000) // 1000 and why.startswith("memory: ")
    assert f"{small.kv_tokens - 16_000} of {small.kv_tokens} KV tokens free" in why
