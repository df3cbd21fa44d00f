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


class ModelPool:
    def __init__(self, size: int, idle_unload: float) -> None:
        self.size = size
        self.idle_unload = idle_unload
        self.resident: dict[str, Resident] = {}

    def plan_load(self, engine_id: str, now: float, need_bytes: int = 0,
                  available_bytes: int | None = None) -> LoadPlan:
        """What to evict so that `engine_id` can load. Raises PoolBusy or NotEnoughMemory."""
        if engine_id in self.resident:
            return LoadPlan([])
        idle = sorted((r for r in self.resident.values() if r.in_flight == 0 and not r.pinned),
                      key=lambda r: r.last_used)
        over = len(self.resident) + 1 - self.size
        if over > len(idle):
            raise PoolBusy(f"all {len(self.resident)} resident models are busy")
        evict = idle[:max(over, 0)]
        if available_bytes is not None and need_bytes:
            freed = sum(r.weight_bytes for r in evict)
            for r in idle[len(evict):]:
                if available_bytes + freed >= need_bytes:
                    break
                evict.append(r)
                freed += r.weight_bytes
            if available_bytes + freed < need_bytes:
                if len(evict) < len(self.resident):
                    raise PoolBusy("not enough memory until a busy model is unloaded")
                raise NotEnoughMemory(
                    f"the model needs about {need_bytes / 2**30:.1f} GiB; "
                    f"{(available_bytes + freed) / 2**30:.1f} GiB would be available")
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


def kv_budget_bytes(spec: str, batch: int | str, tokens: int = 4096) -> int:
    """A KV budget for the memory check: every row at `tokens` of context, 2-byte KV. With
    `--batch auto` the engine sizes its batch to the memory it finds once loaded, so the check
    asks only for room for one row."""
    if not isinstance(batch, int):
        batch = 1
    try:
        cfg = json.loads((Path(spec).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    layers = cfg.get("num_hidden_layers", 0)
    kv_heads = cfg.get("num_key_value_heads", cfg.get("num_attention_heads", 0))
    heads = max(cfg.get("num_attention_heads", 1), 1)
    head_dim = cfg.get("head_dim") or (cfg.get("hidden_size", 0) // heads)
    context = min(cfg.get("max_position_embeddings", tokens), tokens)
    return 2 * layers * kv_heads * head_dim * 2 * context * batch
