"""How many sequences an engine decodes at once (`--batch auto`), from the memory it may use
for KV cache. Pure logic: the engine passes the figures in (engine/batch/runner.py applies it).

A request is admitted into the running batch only if the KV it may come to hold (its prompt
plus its `max_tokens`, at most the context) fits beside what the running rows may come to
hold, within the budget: memory the machine can give (with a model pool, this engine's share
of it, given by the supervisor and changed as engines come and go: daemon/memory_share.py)
minus the model's weights, the RAM prefix cache's capacity (its entries are KV in the same
memory) and a reserve. A new share re-derives the budget from the figures measured at load
(`rebudget`); a share too small for the configured prefix cache trims the cache.
So the batch grows while requests are short and shrinks as contexts get long, and no
admission can push the machine into swap. `--batch N` is an explicit cap on top of it.
`engine/batch/sizing.py` measures the figures at load; the runner's admission applies the rules.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxd.protocol.settings import PoolShare

CEILING = 128  # never more rows than this: past it a step's latency grows for little gain
RESERVE_FRACTION = 0.10  # of the memory the engine may use, kept free for activations etc.
# --prompt-cache auto: the RAM prefix cache's part of what the weights and the reserve leave;
# running rows keep three quarters (a long agent context's row needs its own copy as it grows)
AUTO_CACHE_FRACTION = 0.25


@dataclass(frozen=True)
class KvShape:
    """What one row's cache costs: `layers` append-only KV layers (a token each), plus
    `window_layers` sliding-window layers that hold at most `window` tokens (alike in heads
    and head sizes), plus `state_bytes` of fixed-size recurrent state however long the row."""
    layers: int
    kv_heads: int
    k_head_dim: int
    v_head_dim: int
    bytes_per_element: float  # 2 for float16/bfloat16, 4 for float32, ~0.56 for 4-bit + scales
    window_layers: int = 0
    window: int = 0
    state_bytes: int = 0

    def _per_layer_token(self) -> float:
        return self.kv_heads * (self.k_head_dim + self.v_head_dim) * self.bytes_per_element

    @property
    def bytes_per_token(self) -> int:
        """The unit budgets count in: an append-only token's bytes (a window layer's token,
        for a model with none)."""
        return int((self.layers or self.window_layers) * self._per_layer_token()) or 1

    def row_tokens(self, tokens: int) -> int:
        """A row of `tokens` tokens' cache, in `bytes_per_token` units."""
        if not (self.window_layers or self.state_bytes):
            return tokens
        total = (self.layers * tokens + self.window_layers * min(tokens, self.window)) \
            * self._per_layer_token() + self.state_bytes
        return -int(-total // self.bytes_per_token)


@dataclass(frozen=True)
class Sizing:
    """What a budget is derived from, measured once at load: kept so that a new share (the
    supervisor rebalancing a pool) re-derives the budget from the same figures."""
    available_bytes: int  # see `budget`
    model_bytes: int
    shape: KvShape
    explicit_cap: int | None
    source: str
    cache_bytes: int | None  # the RAM prefix cache's configured capacity (None: auto)
    counted_back: int


@dataclass(frozen=True)
class Budget:
    kv_bytes: int  # memory KV may use, after weights and the reserve
    per_token: int
    explicit_cap: int | None  # --batch N, or None for auto
    why: str  # how the budget was derived, for /stats
    share: float = 1.0  # the fraction of the machine's memory this engine may use (a pool)
    # the RAM prefix cache's capacity within this part: the configured one, less what the
    # weights and the reserve leave no room for (a small share trims the cache, not the rows)
    cache_bytes: int = 0
    sizing: Sizing | None = None  # None: a budget not derived from measured figures

    @property
    def kv_tokens(self) -> int:
        return max(0, self.kv_bytes // self.per_token)


def budget(available_bytes: int, model_bytes: int, shape: KvShape,
           explicit_cap: int | None, source: str, cache_bytes: int | None = 0,
           share: PoolShare | None = None, counted_back: int = 0) -> Budget:
    """`available_bytes`: what the engine may use in all (free memory plus what the model
    already holds, on unified memory; the device's memory on a GPU), or with `share` what
    the machine can give all of the pool's engines (see `machine_memory`). `cache_bytes`: the
    RAM prefix cache's capacity (None: `--prompt-cache auto`, AUTO_CACHE_FRACTION of what the
    weights and the reserve leave). The engine's part is `share.fraction` of it; weights, cache,
    reserve and KV come out of that part. `counted_back`: the other engines' weights in
    `available_bytes` (for the reason shown)."""
    fraction = share.fraction if share is not None else 1.0
    mine = int(available_bytes * fraction)
    room = int(mine * (1 - RESERVE_FRACTION)) - model_bytes  # for the cache and KV
    if cache_bytes is None:
        cache_cap = max(0, int(room * AUTO_CACHE_FRACTION))
        cache = f", prefix cache {_size(cache_cap)} (auto)"
    else:
        cache_cap = max(0, min(cache_bytes, room))
        cache = "" if not cache_bytes else f", prefix cache {_size(cache_cap)}" + (
            f" (of {_size(cache_bytes)})" if cache_cap < cache_bytes else "")
    kv = max(0, room - cache_cap)
    whole = f"{source}: {_size(available_bytes)}"
    if share is not None and (fraction < 1 or share.pool > 1):
        back = (f" (the other engines' weights {_size(counted_back)} counted back)"
                if counted_back else "")
        part = f" = {_size(mine)}" if fraction < 1 else ""
        whole = (f"share {fraction:.0%} (--model-pool {share.pool}, {share.others} other "
                 f"engine(s)) of {whole}{back}{part}")
    why = (f"{whole}, weights {_size(model_bytes)}{cache}, {RESERVE_FRACTION:.0%} reserve -> "
           f"{_size(kv)} for KV at {shape.bytes_per_token / 1024:.1f} KiB/token")
    sizing = Sizing(available_bytes, model_bytes, shape, explicit_cap, source, cache_bytes,
                    counted_back)
    return Budget(kv, shape.bytes_per_token, explicit_cap, why, fraction, cache_cap, sizing)


def rebudget(b: Budget, share: PoolShare) -> Budget:
    """The budget for a new share (the supervisor rebalanced the pool), from the figures
    measured at load: the machine's memory, the weights, the KV per token, the cache's
    configured capacity. A budget without them is kept."""
    s = b.sizing
    if s is None:
        return b
    return budget(s.available_bytes, s.model_bytes, s.shape, s.explicit_cap, s.source,
                  s.cache_bytes, share, s.counted_back)


def _size(n: int) -> str:
    """GiB, or MiB below one GiB (a small model's weights are not "0.0 GiB")."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 or n == 0 else f"{n / 2**20:.1f} MiB"


def machine_memory(found_bytes: int, share: PoolShare | None, whole: bool) -> int:
    """What the machine can give all the engines of the pool, from what this engine found at
    load (free memory plus its own weights): the other engines' loaded weights are counted
    back, since free memory lacks them. A `whole` figure (one the user forced with
    `--engine-memory`, Metal's working-set limit) is already the pool's."""
    if share is None or whole:
        return found_bytes
    return found_bytes + share.others_weight_bytes


def reserved_tokens(prompt_tokens: int, max_tokens: int, context: int,
                    shape: KvShape | None = None) -> int:
    """The most KV tokens one request can come to hold (with `shape`, in its units: a window
    layer holds at most its window, a recurrent state a constant)."""
    n = min(prompt_tokens + max_tokens, context) if context else prompt_tokens + max_tokens
    return shape.row_tokens(n) if shape is not None else n


def may_admit(b: Budget, running: int, running_reserved: int, request_reserved: int) -> bool:
    """Whether a request reserving `request_reserved` tokens joins `running` rows that reserve
    `running_reserved`. One row is always allowed when nothing runs (a request that alone
    exceeds the budget is the context check's business, not a reason to wait for ever)."""
    if running >= cap_of(b):
        return False
    if running == 0:
        return True
    return running_reserved + request_reserved <= b.kv_tokens


def current_cap(b: Budget, running: int, running_reserved: int, typical_reserved: int) -> int:
    """The batch the budget allows now, for /stats: running rows plus as many more of the
    typical size as fit, within the cap."""
    room = max(0, b.kv_tokens - running_reserved)
    more = room // max(1, typical_reserved)
    return max(1, min(cap_of(b), running + more))


def cap_of(b: Budget) -> int:
    return b.explicit_cap if b.explicit_cap is not None else CEILING


def explicit_cap(batch: int | str) -> int | None:
    """The `--batch` setting as a cap: N, or None for auto."""
    return batch if isinstance(batch, int) else None


def ceiling(batch: int | str) -> int:
    """The most rows the generator is ever given: N, or CEILING for auto."""
    return batch if isinstance(batch, int) else CEILING


def explain(b: Budget, running: int, running_reserved: int,
            typical_reserved: int) -> tuple[int, str]:
    """The cap in force now and why, for /stats: which bound holds (an explicit --batch, the
    ceiling, or memory for rows of the typical size), then how the budget was derived."""
    cap = current_cap(b, running, running_reserved, typical_reserved)
    if cap < cap_of(b):
        limit = (f"memory: {b.kv_tokens - running_reserved} of {b.kv_tokens} KV tokens free "
                 f"for rows of ~{typical_reserved} tokens")
    elif b.explicit_cap is not None:
        limit = f"--batch {b.explicit_cap}"
    else:
        limit = f"the ceiling ({CEILING}); memory would allow more"
    return cap, f"{limit}; {b.why}"
