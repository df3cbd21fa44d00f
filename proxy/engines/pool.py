"""Which engines stay resident: the LRU model pool (runs in the proxy). Pure logic, no sockets.

It lives in the proxy, not the supervisor, because eviction must be decided atomically with
routing: the proxy knows which engines have requests in flight, and once it has picked a victim
no new request is routed there (one event loop, no race). The supervisor only executes
(start / stop) and keeps the processes alive.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

PIN = -1.0
# Of each engine's part of the memory, what it keeps free for activations: the engine's own
# rule (engine/batch/budget.RESERVE_FRACTION; a test holds them equal).
RESERVE_FRACTION = 0.10


@dataclass
class Resident:
    engine_id: str
    last_used: float
    in_flight: int = 0
    keep_until: float | None = None  # from a request's keep_alive; None: the pool's idle rule
    pinned: bool = False
    weight_bytes: int = 0


@dataclass
class LoadPlan:
    evict: list[str]


class PoolBusy(Exception):
    """Every resident engine is busy (or pinned): the request must wait."""


class NotEnoughMemory(Exception):
    pass


@dataclass(frozen=True)
class MemoryNeed:
    """What loading a model asks of the memory (the check before a load; figures only)."""
    weight_bytes: int  # the new model's weights (0: unknown, a repo id)
    row_bytes: int  # the KV of one row: an engine always admits one, whatever its budget
    available_bytes: int  # free memory now

    @property
    def total(self) -> int:
        return self.weight_bytes + self.row_bytes


def memory_shortfall(need: MemoryNeed, resident_weights: list[int],
                     evicted_weights: list[int]) -> str | None:
    """Why the model cannot load once `evicted_weights`' engines are gone (None: it can), with
    `resident_weights` the weights of every resident engine (evicted ones included).

    - now: its weights and one row must fit in the free memory plus the evicted engines'
      weights (their KV is not counted: only smaller, the safe side). Free memory is not
      asked for a full batch: the engines' KV budgets, not `--batch`, bound what they admit;
    - its part: the supervisor gives the engines that stay and the new one equal parts of the
      machine's memory (daemon/memory_share.py; the others shrink as it starts), and an engine
      keeps 10 % of its part in reserve; weights and one row must fit in the rest, or it
      could serve only by eating into the reserve. The machine's memory is what the engines
      count from: the free memory plus the resident engines' weights."""
    freed = sum(evicted_weights)
    if need.available_bytes + freed < need.total:
        return (f"the model needs about {_gib(need.total)} (its weights and one row of KV); "
                f"{_gib(need.available_bytes + freed)} would be available")
    machine = need.available_bytes + sum(resident_weights)
    engines = len(resident_weights) - len(evicted_weights) + 1
    part = int(machine / engines * (1 - RESERVE_FRACTION))
    if part < need.total:
        beside = f", beside {engines - 1} other model(s)" if engines > 1 else ""
        return (f"the model needs about {_gib(need.total)} (its weights and one row of KV); "
                f"its part of the memory would be {_gib(part)} ({100 / engines:.0f}% of "
                f"{_gib(machine)}{beside}, less a {RESERVE_FRACTION:.0%} reserve)")
    return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


class ModelPool:
    def __init__(self, size: int, idle_unload: float) -> None:
        self.size = size
        self.idle_unload = idle_unload
        self.resident: dict[str, Resident] = {}

    def plan_load(self, engine_id: str, now: float,
                  need: MemoryNeed | None = None) -> LoadPlan:
        """What to evict so that `engine_id` can load: the least recently used idle engines,
        as many as the pool's size asks, then more while the memory falls short (see
        `memory_shortfall`). Raises PoolBusy or NotEnoughMemory."""
        if engine_id in self.resident:
            return LoadPlan([])
        idle = sorted((r for r in self.resident.values() if r.in_flight == 0 and not r.pinned),
                      key=lambda r: r.last_used)
        over = len(self.resident) + 1 - self.size
        if over > len(idle):
            raise PoolBusy(f"all {len(self.resident)} resident models are busy")
        evict = idle[:max(over, 0)]
        if need is not None:
            weights = [r.weight_bytes for r in self.resident.values()]
            short = memory_shortfall(need, weights, [r.weight_bytes for r in evict])
            for r in idle[len(evict):]:
                if short is None:
                    break
                evict.append(r)
                short = memory_shortfall(need, weights, [r.weight_bytes for r in evict])
            if short is not None:
                if len(evict) < len(self.resident):
                    raise PoolBusy("not enough memory until a busy model is unloaded")
                raise NotEnoughMemory(short)
        return LoadPlan([r.engine_id for r in evict])

    def add(self, engine_id: str, now: float, weight_bytes: int = 0) -> None:
        self.resident[engine_id] = Resident(engine_id, now, weight_bytes=weight_bytes)

    def remove(self, engine_id: str) -> None:
        self.resident.pop(engine_id, None)

    def begin(self, engine_id: str, now: float) -> None:
        r = self.resident.get(engine_id)
        if r is not None:
            r.in_flight += 1
            r.last_used = now

    def end(self, engine_id: str, now: float, keep_alive: float | None) -> None:
        r = self.resident.get(engine_id)
        if r is None:
            return
        r.in_flight = max(0, r.in_flight - 1)
        r.last_used = now
        if keep_alive is None:
            return
        if keep_alive < 0:
            r.pinned, r.keep_until = True, None
        else:
            r.pinned, r.keep_until = False, now + keep_alive

    def expired(self, now: float) -> list[str]:
        """Idle engines whose keep_alive (or the pool's --idle-unload) has run out."""
        out = []
        for r in self.resident.values():
            if r.in_flight or r.pinned:
                continue
            if r.keep_until is not None:
                if now >= r.keep_until:
                    out.append(r.engine_id)
            elif self.idle_unload > 0 and now - r.last_used >= self.idle_unload:
                out.append(r.engine_id)
        return out


_DURATION = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")


def parse_keep_alive(value: object) -> float | None:
    """Seconds from a keep_alive value: a number (seconds) or Ollama's "5m" / "1h" / "-1"."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError("keep_alive must be a number of seconds or a duration like '5m'")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value)):
        unit = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m.group(2) or "s"]
        seconds = float(m.group(1)) * unit
    else:
        raise ValueError("keep_alive must be a number of seconds or a duration like '5m'")
    return PIN if seconds < 0 else seconds


def looks_like_repo_id(name: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name))


def model_weight_bytes(spec: str) -> int:
    path = Path(spec).expanduser()
    if not path.is_dir():
        return 0
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def kv_bytes_per_element(dtype: str, kv_bits: int | None, group_size: int) -> float:
    """What one K or V element takes: `--kv-bits` packed, plus a float16 scale and bias per
    group (mlx-lm's quantized KV cache: 0.5625 at 4 bits, group 64); else the activation
    dtype's size (float32: 4; the model's own, usually 16-bit, otherwise: 2. `auto` is
    float32 on MLX's CPU backend, which the proxy cannot see: 2 there underestimates)."""
    if kv_bits:
        return kv_bits / 8 + 2 * 2 / group_size
    return 4.0 if dtype == "float32" else 2.0


def row_kv_bytes(spec: str, per_element: float = 2.0, tokens: int = 4096) -> int:
    """The KV of one row at `tokens` of context (at most the model's) for the memory check
    before a load: an engine admits one row whatever its budget, and more only within its
    budget (its part of the memory: engine/batch/budget.py), whatever `--batch` says."""
    try:
        cfg = json.loads((Path(spec).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    layers = cfg.get("num_hidden_layers", 0)
    kv_heads = cfg.get("num_key_value_heads", cfg.get("num_attention_heads", 0))
    heads = max(cfg.get("num_attention_heads", 1), 1)
    head_dim = cfg.get("head_dim") or (cfg.get("hidden_size", 0) // heads)
    context = min(cfg.get("max_position_embeddings", tokens), tokens)
    return int(layers * kv_heads * head_dim * 2 * context * per_element)
