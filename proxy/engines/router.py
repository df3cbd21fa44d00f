"""From a request's `model` to a ready engine: names, aliases, on-demand loading through the
supervisor, the LRU pool, keep_alive and idle unloading. Runs in the proxy."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import psutil

from mlxd.protocol.messages import ResetChild, StartEngine, StopEngine, ToSupervisor
from mlxd.protocol.models import (
    adapter_bytes,
    canonical_spec,
    engine_id_for,
    local_model_dir,
    model_id,
    parse_adapter,
)
from mlxd.proxy.bounds import MAX_REPO_PART, clip
from mlxd.proxy.engines.client import EngineClient, EngineRecord
from mlxd.proxy.engines.pool import (
    MemoryNeed,
    ModelPool,
    NotEnoughMemory,
    PoolBusy,
    looks_like_repo_id,
    model_weight_bytes,
    row_kv_bytes,
)
from mlxd.proxy.engines.resolution import LoadableCache
from mlxd.proxy.errors import APIError, unavailable, without_paths

log = logging.getLogger("mlxd.proxy")

FAILED_TTL = 300.0  # seconds a failed on-demand model stays listed (with its reason)

Send = Callable[[ToSupervisor], Awaitable[None]]


class Router:
    def __init__(self, client: EngineClient, *, load_wait: float, aliases: dict[str, str],
                 pool: ModelPool | None = None, send: Send | None = None,
                 batch: int | str = "auto", kv_element_bytes: float = 2.0,
                 pool_wait: float = 60.0, pool_queue: int = 32,
                 adapters: dict[str, str] | None = None) -> None:
        self.client = client
        # LoRA adapter name -> its base's spec (canonical): served by the base's engine
        self.adapters: dict[str, str] = {}
        self.adapter_dirs = adapters or {}  # name -> "BASE:DIR", as configured
        for name, value in self.adapter_dirs.items():
            try:
                self.adapters[name] = canonical_spec(parse_adapter(value)[0])
            except ValueError:
                log.warning("adapter %s: %r is not BASE:DIR; ignored", name, value)
        self.load_wait = load_wait
        self.aliases = aliases
        self.pool = pool  # None without --isolate: only the configured engines exist
        self.send = send
        # --batch: not part of the memory check (the engines' KV budgets, not --batch, bound
        # the rows they admit)
        self.batch = batch
        self.kv_element_bytes = kv_element_bytes  # the memory check's KV size (--kv-bits)
        self.pool_wait = pool_wait
        self.pool_queue = pool_queue
        self.configured = set(client.engines)  # started with the daemon
        self._idle = asyncio.Condition()
        self._waiting = 0
        self.active = 0  # requests between acquire and release
        self.draining = False
        self._none_active = asyncio.Event()
        self._none_active.set()
        self.loadable = LoadableCache()
        if pool is not None:
            now = time.monotonic()
            for eid, rec in client.engines.items():
                pool.add(eid, now, self.weight_bytes(rec.spec))

    # ------------------------------------------------------------------ names

    def weight_bytes(self, spec: str) -> int:
        """A model's weights in memory: its files plus the adapters its engine holds."""
        return model_weight_bytes(spec) + adapter_bytes(self.adapter_dirs, spec)

    def adapter_of(self, name: str | None) -> str:
        """The adapter a request's model name selects ("": the base model itself)."""
        return name if name and name in self.adapters else ""

    def lookup(self, name: str | None) -> str:
        """The model spec a request names; 404 if it names nothing we can serve."""
        return self.resolve(name)[0]

    def resolve(self, name: str | None) -> tuple[str, str]:
        """The model spec a request names and its engine id; 404 if it names nothing we can
        serve. A known engine's id is its record's: deriving it from the spec again would
        stat the model's path on every request."""
        if name and name in self.adapters:
            spec = self.adapters[name]
            base = next((r for r in self.client.engines.values() if r.spec == spec), None)
            return spec, base.engine_id if base is not None else engine_id_for(spec)
        rec = self.client.find(name)
        if rec is not None:
            return rec.spec, rec.engine_id
        spec = self._spec_of_new(name)
        return spec, engine_id_for(spec)

    def _spec_of_new(self, name: str | None) -> str:
        """The spec of a model no engine record knows yet (an alias, a path, a repo id)."""
        assert name
        if name in self.aliases:
            return canonical_spec(self.aliases[name])
        if self.pool is not None:
            path = local_model_dir(name)
            if path is not None:
                return str(path)
            if looks_like_repo_id(name) and all(
                    len(part) <= MAX_REPO_PART for part in name.split("/")):
                return name
        # Served ids only: an engine's other names include the paths it was started with,
        # which are no business of a client that mistyped a name.
        known = sorted({r.model_id for r in self.client.engines.values()}
                       | set(self.aliases) | set(self.adapters))
        raise APIError(404, f"the model {clip(name)!r} does not exist; available: "
                       f"{clip(', '.join(known), 2000)}", code="model_not_found", param="model")

    # ------------------------------------------------------------------ acquire / release

    async def acquire(self, name: str | None) -> EngineRecord:
        """A ready engine for `name`, counted as busy until `release`."""
        if self.draining:
            raise unavailable("mlxd is draining (shutting down or paused by /admin/drain) and "
                              "takes no new requests", "draining", retry_after=5)
        spec, eid = self.resolve(name)
        self.active += 1
        self._none_active.clear()
        if self.pool is not None and eid not in self.pool.resident:
            try:
                await self.loadable.check(spec, name)  # before anyone is evicted for it
                await self._load(eid, spec)
            except BaseException:
                self._leave()
                raise
        rec = self.client.record(eid, spec)
        if name and name not in rec.names and name not in self.adapters:
            rec.names.append(name)  # an alias or another spelling of the path
        if self.pool is not None:
            self.pool.begin(eid, time.monotonic())
        try:
            await self._wait_ready(rec)
        except BaseException:
            await self.release(rec, None)
            raise
        return rec

    @property
    def waiting(self) -> int:
        return self._waiting

    def _leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._none_active.set()

    async def wait_none_active(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._none_active.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def release(self, rec: EngineRecord, keep_alive: float | None) -> None:
        self._leave()
        if self.pool is None:
            return
        self.pool.end(rec.engine_id, time.monotonic(), keep_alive)
        if keep_alive == 0:
            await self.unload_idle([rec.engine_id])
        async with self._idle:
            self._idle.notify_all()

    async def _wait_ready(self, rec: EngineRecord) -> None:
        if rec.state != "ready" and not await self.client.wait_ready(rec, self.load_wait):
            raise unavailable(f"the model {rec.model_id} is still loading; retry shortly",
                              "engine_loading", retry_after=5)
        if rec.state == "failed":
            if self.pool is not None and rec.engine_id not in self.configured:
                await self._drop_failed(rec)
            raise unavailable(f"the model {rec.model_id} failed: {without_paths(rec.error or '')}",
                              "model_failed",
                              retry_after=30)
        if rec.state != "ready":
            raise unavailable(f"the model {rec.model_id} is {rec.state}", "engine_unavailable")

    async def _drop_failed(self, rec: EngineRecord) -> None:
        """An on-demand load that failed frees its pool slot and its supervisor entry; the
        record stays listed as failed (with the reason) for FAILED_TTL."""
        assert self.pool is not None and self.send is not None
        if rec.engine_id in self.pool.resident:
            self.pool.remove(rec.engine_id)
            self.loadable.forget(rec.spec)
            rec.failed_reason = rec.error
            rec.failed_at = time.monotonic()
            await self.send(StopEngine(rec.engine_id))

    def _clear_failed(self, rec: EngineRecord) -> None:
        """Forget a failed model: it is listed as unloaded, or not at all if on demand."""
        if rec.engine_id in self.configured:
            if rec.child is not None:
                rec.min_epoch = rec.child.epoch + 1
            rec.child, rec.status, rec.failed_at, rec.failed_reason = None, None, None, None
            rec.ready.clear()
        else:
            self.client.forget(rec.engine_id)

    async def _load(self, eid: str, spec: str) -> None:
        assert self.pool is not None and self.send is not None
        deadline = time.monotonic() + self.pool_wait
        weights = self.weight_bytes(spec)
        row = row_kv_bytes(spec, self.kv_element_bytes)
        while True:
            if eid in self.pool.resident:
                return
            try:
                plan = self.pool.plan_load(eid, time.monotonic(), MemoryNeed(
                    weights, row, psutil.virtual_memory().available))
            except NotEnoughMemory as e:
                raise unavailable(f"cannot load {model_id(spec)}: {e}", "insufficient_memory",
                                  retry_after=30) from e
            except PoolBusy:
                await self._wait_for_idle(deadline)
                continue
            # Decided with no await in between: no request can be routed to a victim now.
            for victim in plan.evict:
                self.pool.remove(victim)
            self.pool.add(eid, time.monotonic(), self.weight_bytes(spec))
            rec = self.client.record(eid, spec)
            rec.ready.clear()
            rec.status = None
            if rec.child is not None:  # the supervisor sends the new child's state; the
                rec.min_epoch = rec.child.epoch + 1  # old one's, arriving late, is ignored
                rec.child = None
            rec.failed_at = rec.failed_reason = None
            for victim in plan.evict:
                log.info("evicting %s to load %s", self.client.engines[victim].model_id, spec)
                await self.send(StopEngine(victim))
            log.info("loading %s on demand", spec)
            await self.send(StartEngine(eid, spec))
            return

    async def _wait_for_idle(self, deadline: float) -> None:
        if self._waiting >= self.pool_queue:
            raise unavailable("every resident model is busy and the pool queue is full",
                              "pool_busy", retry_after=5)
        left = deadline - time.monotonic()
        if left <= 0:
            raise unavailable("every resident model is busy; retry shortly", "pool_busy",
                              retry_after=5)
        self._waiting += 1
        try:
            async with self._idle:
                await asyncio.wait_for(self._idle.wait(), left)
        except TimeoutError:
            raise unavailable("every resident model stayed busy; retry shortly", "pool_busy",
                              retry_after=5) from None
        finally:
            self._waiting -= 1

    # ------------------------------------------------------------------ admin

    async def load(self, name: str) -> EngineRecord:
        rec = await self.acquire(name)
        await self.release(rec, None)
        return rec

    async def unload(self, name: str) -> EngineRecord:
        if self.pool is None:
            raise APIError(400, "models are loaded and unloaded only with --isolate",
                           code="not_supported")
        spec, eid = self.resolve(name)
        rec = self.client.record(eid, spec)
        r = self.pool.resident.get(eid)
        if rec.state == "failed" and not (r and r.in_flight):
            # A failed model can always be cleared, resident or not.
            self.pool.remove(eid)
            assert self.send is not None
            await self.send(StopEngine(eid))
            self._clear_failed(rec)
            return rec
        if r is None:
            raise APIError(409, f"the model {rec.model_id} is not loaded", code="not_loaded")
        if r.in_flight:
            raise APIError(409, f"the model {rec.model_id} has {r.in_flight} requests in flight",
                           code="model_busy")
        await self.unload_idle([eid])
        return rec

    async def reset(self, name: str) -> EngineRecord:
        spec, eid = self.resolve(name)
        rec = self.client.record(eid, spec)
        if self.send is None:
            raise APIError(400, "reset needs --isolate", code="not_supported")
        await self.send(ResetChild(eid))
        return rec

    async def unload_idle(self, engine_ids: list[str]) -> None:
        assert self.pool is not None and self.send is not None
        for eid in engine_ids:
            r = self.pool.resident.get(eid)
            if r is None or r.in_flight:
                continue
            self.pool.remove(eid)
            log.info("unloading %s", self.client.engines[eid].model_id)
            await self.send(StopEngine(eid))
        async with self._idle:
            self._idle.notify_all()

    async def idle_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)  # the idle-unload timer's tick
            if self.pool is not None:
                now = time.monotonic()
                expired = self.pool.expired(now)
                if expired:
                    await self.unload_idle(expired)
                for rec in list(self.client.engines.values()):
                    if rec.failed_at is not None and now - rec.failed_at > FAILED_TTL:
                        self._clear_failed(rec)
