"""`--batch auto` sizing (engine/batch_budget.py): pure logic from memory figures."""

from __future__ import annotations

from collections.abc import Sequence

from mlxd.daemon.memory_share import Engine, shares, weight_bytes_on_disk
from mlxd.engine.batch.budget import (
    AUTO_CACHE_FRACTION,
    CEILING,
    Budget,
    KvShape,
    budget,
    cap_of,
    ceiling,
    current_cap,
    explain,
    explicit_cap,
    machine_memory,
    may_admit,
    rebudget,
    reserved_tokens,
)
from mlxd.engine.batch.sizing import FORCED, free_based
from mlxd.protocol.settings import PoolShare

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


def test_an_auto_prefix_cache_is_a_quarter_of_what_the_weights_leave_and_follows_the_share():
    b = budget(64 * GiB, 4 * GiB, LLAMA_1B, None, "test", cache_bytes=None)
    room = int(64 * GiB * 0.9) - 4 * GiB
    assert b.cache_bytes == int(room * AUTO_CACHE_FRACTION) and 0 < AUTO_CACHE_FRACTION < 1
    assert b.kv_bytes == room - b.cache_bytes and "(auto)" in b.why
    half = rebudget(b, PoolShare(fraction=0.5, pool=2, others=1))
    half_room = int(32 * GiB * 0.9) - 4 * GiB
    assert half.cache_bytes == int(half_room * AUTO_CACHE_FRACTION)
    assert half.kv_bytes == half_room - half.cache_bytes
    tight = budget(4 * GiB, 4 * GiB, LLAMA_1B, None, "test", cache_bytes=None)
    assert tight.cache_bytes == 0 == tight.kv_bytes  # the weights leave nothing


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


# ---------------------------------------------------------------- engines of one model pool
# The supervisor gives each engine of a pool a fraction of the machine's memory, 1/k for k
# engines, and changes it as engines come and go (daemon/memory_share.py); the engine sizes its
# KV within it (budget(share=...)) and re-derives it from its measured figures when its share
# changes (rebudget). Simulated here on a machine of M bytes: each engine, as it loads, finds
# the free memory (M less the weights already loaded: KV is allocated only as rows run) plus
# its own weights, and the supervisor counts back the weights of the engines already loaded.

SMOL = KvShape(layers=30, kv_heads=3, k_head_dim=64, v_head_dim=64, bytes_per_element=2)
LLAMA_8B = KvShape(layers=32, kv_heads=8, k_head_dim=128, v_head_dim=128, bytes_per_element=2)


def load_pool(machine: int, pool: int, models: Sequence[tuple[int, KvShape, int | None]],
              cache: int = 0, forced: bool = False) -> list[tuple[int, Budget]]:
    """Engines loaded one after the other, the shares rebalanced before each starts: (weights,
    KV shape, --batch N or None) each. Each engine's weights and budget once all are loaded."""
    out: list[tuple[int, Budget]] = []
    for i, (weights, shape, cap) in enumerate(models):
        given = shares(pool, [Engine(str(j), True, out[j][0] if j < i else 0)
                              for j in range(i + 1)])
        out = [(w, rebudget(b, given[str(j)])) for j, (w, b) in enumerate(out)]
        share = given[str(i)]
        # free memory once its weights are in, plus them: the machine less the others' weights
        found = machine if forced else machine - sum(w for w, _ in out)
        whole = machine_memory(found, share, whole=forced)
        out.append((weights, budget(whole, weights, shape, cap, FORCED if forced
                                    else "RAM", cache, share, whole - found)))
    return out


def in_use(engines: list[tuple[int, Budget]], cache: int = 0) -> int:
    """What the engines may come to hold together: weights, prefix caches, every KV budget."""
    return sum(w + cache + b.kv_bytes for w, b in engines)


def test_one_engine_alone_gets_everything():
    (alone,) = load_pool(16 * GiB, 1, [(2 * GiB, LLAMA_1B, None)])
    assert alone[1] == budget(16 * GiB, 2 * GiB, LLAMA_1B, None, "RAM")  # as before pools
    assert shares(1, [Engine("a", True)]) == {"a": PoolShare()} and "share" not in alone[1].why


def test_a_lone_engine_of_a_pool_takes_everything_until_another_starts():
    m = 16 * GiB
    (alone,) = load_pool(m, 2, [(2 * GiB, LLAMA_1B, None)])
    assert alone[1].share == 1.0 and alone[1].kv_bytes == int(m * 0.9) - 2 * GiB
    assert "share 100% (--model-pool 2, 0 other engine(s))" in alone[1].why
    (a, b) = load_pool(m, 2, [(2 * GiB, LLAMA_1B, None), (1 * GiB, LLAMA_1B, None)])
    assert a[1].share == 0.5 and a[1].kv_bytes == int(m / 2 * 0.9) - 2 * GiB  # shrunk first
    # b unloaded: a grows back to what it had alone, from the figures it measured at load
    assert rebudget(a[1], PoolShare(fraction=1.0, pool=2)) == alone[1]


def test_a_new_share_keeps_the_measured_figures_and_trims_the_prefix_cache():
    b = budget(16 * GiB, 2 * GiB, LLAMA_1B, 8, "RAM", 4 * GiB, PoolShare(fraction=1.0, pool=2))
    assert (b.kv_bytes, b.cache_bytes) == (int(16 * GiB * 0.9) - 6 * GiB, 4 * GiB)
    quarter = rebudget(b, PoolShare(fraction=0.25, pool=4, others=3))
    # 4 GiB, 3.6 once the reserve is off, 2 of it weights: 1.6 GiB for the cache, none for KV
    assert quarter.kv_bytes == 0 and quarter.cache_bytes == int(4 * GiB * 0.9) - 2 * GiB
    assert quarter.explicit_cap == 8 and quarter.per_token == b.per_token
    assert "prefix cache 1.6 GiB (of 4.0 GiB)" in quarter.why and "share 25%" in quarter.why
    half = rebudget(quarter, PoolShare(fraction=0.5, pool=4, others=1))
    assert half.cache_bytes == 4 * GiB and half.kv_bytes == int(8 * GiB * 0.9) - 6 * GiB
    fixed = Budget(100, 10, None, "given")  # not measured: nothing to re-derive it from
    assert rebudget(fixed, PoolShare(fraction=0.5, pool=2)) is fixed


def test_two_engines_share_the_memory_instead_of_each_taking_all_of_it():
    m = 16 * GiB
    a, b = load_pool(m, 2, [(2 * GiB, LLAMA_1B, None), (1 * GiB, LLAMA_1B, None)])
    assert a[1].share == b[1].share == 0.5
    assert in_use([a, b]) <= m * 0.9  # fits, whatever the load order
    assert in_use([a, b]) >= m * 0.9 - 16  # and leaves nothing unused (rounding aside)
    # each engine alone, as before: together they would have claimed almost twice the memory
    alone = [budget(m, 2 * GiB, LLAMA_1B, None, "RAM"),
             budget(m - 2 * GiB, 1 * GiB, LLAMA_1B, None, "RAM")]
    assert sum(x.kv_bytes for x in alone) + 3 * GiB > 1.6 * m
    assert "share 50% (--model-pool 2, 1 other engine(s))" in b[1].why
    assert "other engines' weights 2.0 GiB counted back" in b[1].why
    assert "share 50% (--model-pool 2, 1 other engine(s))" in a[1].why


def test_three_engines_and_the_order_they_load_in():
    m = 64 * GiB
    models = [(16 * GiB, LLAMA_8B, None), (1 * GiB, LLAMA_1B, None), (GiB // 4, SMOL, None)]
    for order in (models, models[::-1]):
        for pool in (2, 3):  # a third engine in a pool of 2 (a load racing an unload): thirds
            engines = load_pool(m, pool, order, cache=2 * GiB)
            assert [round(b.share, 6) for _, b in engines] == [round(1 / 3, 6)] * 3
            assert m * 0.9 - 16 <= in_use(engines, cache=2 * GiB) <= m * 0.9


def test_models_of_different_kv_cost_get_equal_memory_and_different_rows():
    m = 32 * GiB
    big, small = load_pool(m, 2, [(2 * GiB, LLAMA_8B, None), (2 * GiB, SMOL, None)])
    assert big[1].kv_bytes == small[1].kv_bytes  # same weights: same bytes for KV
    assert big[1].per_token == 131072 and small[1].per_token == 23040
    assert small[1].kv_tokens > 5 * big[1].kv_tokens  # the cheaper KV holds more tokens
    long_row = reserved_tokens(4000, 1000, 8192)
    assert current_cap(small[1], 0, 0, long_row) > 5 * current_cap(big[1], 0, 0, long_row)
    heavy, light = load_pool(m, 2, [(12 * GiB, LLAMA_1B, None), (1 * GiB, LLAMA_1B, None)])
    # weights are inside the share: the heavy model's half holds mostly weights
    assert heavy[1].kv_bytes == int(m / 2 * 0.9) - 12 * GiB
    assert light[1].kv_bytes - heavy[1].kv_bytes == 11 * GiB
    assert in_use([heavy, light]) <= m * 0.9


def test_an_explicit_batch_stays_a_cap_within_the_share():
    m = 16 * GiB
    a, b = load_pool(m, 2, [(1 * GiB, LLAMA_1B, 4), (1 * GiB, LLAMA_1B, None)])
    assert a[1].kv_bytes == b[1].kv_bytes and a[1].share == 0.5
    assert cap_of(a[1]) == 4 and current_cap(a[1], 0, 0, 100) == 4  # memory allows more
    cap, why = explain(a[1], 0, 0, 100)
    assert cap == 4 and why.startswith("--batch 4;") and "share 50%" in why
    tight = load_pool(3 * GiB, 2, [(1 * GiB, LLAMA_1B, 64), (1 * GiB, LLAMA_1B, 64)])
    # the share binds before --batch 64 does: ~0.35 GiB, ~11k tokens, 11 rows of 1000
    assert current_cap(tight[0][1], 0, 0, 1000) == tight[0][1].kv_tokens // 1000 < 64


def test_a_forced_memory_figure_is_the_whole_pool():
    m = 8 * GiB
    engines = load_pool(m, 2, [(1 * GiB, LLAMA_1B, None), (3 * GiB, LLAMA_1B, None)],
                        forced=True)
    assert [b.kv_bytes for _, b in engines] == [int(m / 2 * 0.9) - w for w in (GiB, 3 * GiB)]
    assert "counted back" not in engines[1][1].why
    assert machine_memory(m, PoolShare(fraction=0.5, others_weight_bytes=GiB), True) == m
    assert free_based("RAM (3.0 GiB available + the weights)")
    assert free_based("GPU memory (70.0 GiB free + 1.0 GiB held by MLX)")
    assert not free_based("unified memory (the GPU's recommended working set)")
    assert not free_based(FORCED)


def test_weights_on_disk_are_a_model_directorys_safetensors(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "model-2.safetensors").write_bytes(b"x" * 24)
    (tmp_path / "config.json").write_text("{}")
    assert weight_bytes_on_disk(str(tmp_path)) == 1024
    assert weight_bytes_on_disk("org/some-repo") == 0


def test_a_window_layer_costs_at_most_its_window_and_a_recurrent_state_a_constant():
    # gemma3-like: 2 global layers and 2 sliding-window layers of 16 tokens, same heads
    mixed = KvShape(2, 2, 16, 16, 4, window_layers=2, window=16)
    assert mixed.bytes_per_token == 2 * 2 * 32 * 4  # the unit: an append-only token
    assert mixed.row_tokens(10) == 20  # short rows: every layer holds every token
    assert mixed.row_tokens(1000) == 1000 + 16  # long rows: the windows stop at 16
    assert reserved_tokens(900, 100, 0, mixed) == 1016
    plain = KvShape(4, 2, 16, 16, 4)  # the same model if it had no windows
    assert plain.row_tokens(1000) * plain.bytes_per_token > \
        mixed.row_tokens(1000) * mixed.bytes_per_token
    # a pure recurrent model: the same bytes per row whatever its length
    recurrent = KvShape(0, 0, 0, 0, 0, state_bytes=4096)
    assert recurrent.row_tokens(10) == recurrent.row_tokens(100_000) == 4096
    b = budget(10 * 2**20 + 1000, 1000, recurrent, None, "test")
    rows = b.kv_tokens // recurrent.row_tokens(100_000)
    assert 2000 < rows < 2600  # ~9 MiB of KV room at 4 KiB a row, however long


def test_sizing_measures_windows_and_states_from_a_forward_pass(tmp_path):
    import mlx.core as mx

    from mlxd.engine.batch.sizing import kv_shape
    from mlxd.engine.load.loader import load_model
    from support.random_model import write_random_model
    gemma, _, _ = load_model(str(write_random_model(tmp_path / "g", family="gemma3_text")),
                             tmp_path / "c")
    shape = kv_shape(gemma, mx.default_stream(mx.default_device()))
    assert (shape.layers, shape.window_layers, shape.window) == (2, 2, 16)
    mamba, _, _ = load_model(str(write_random_model(tmp_path / "m", family="mamba2")),
                             tmp_path / "c")
    shape = kv_shape(mamba, mx.default_stream(mx.default_device()))
    assert shape.layers == shape.window_layers == 0 and shape.state_bytes > 0
