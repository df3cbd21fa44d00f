"""Admission into the running rows, from the best prefix at hand (the MLX thread; the runner's
part that decides where a request's prompt starts).

A request is inserted from the longest prefix it can borrow: a prefill group's shared layers
(the answers to one prompt, `n`), the SSD tier's restored blocks, or the RAM tier's entry.
Requests that share a long uncached prefix with one still prefilling (`sharing.leader_for`)
wait for it as its followers and then hit the cache: N agents with one system prompt prefill
it once. Members of a prefill group wait for their leader's prompt and start from a view of
it. With state layers, rows stop at their prompts' snapshot points on the way.

`PrefixAdmission` is a part of `batch.runner.Runner` (a mixin): it reads the runner's
generator, rows, caches and counters, and owns `_groups`.
"""

from __future__ import annotations

import queue
import time
from typing import Any

from mlx_lm.generate import BatchGenerator, StopSequences

from mlxd.engine.batch.admission.sharing import leader_for, meeting_points
from mlxd.engine.batch.burst import lend_floor
from mlxd.engine.batch.counters import RunnerCounters
from mlxd.engine.batch.messages import AddRequest, RequestStarted
from mlxd.engine.batch.publish import Publisher, shared_prefix
from mlxd.engine.batch.rows import GROUP_TTL, PrefillGroup, Row, RowTable
from mlxd.engine.kv.codec import CacheCodec, Held, kv_slice, to_mx
from mlxd.engine.kv.prefix_cache import PrefixCache, common_prefix
from mlxd.engine.kv.snapshot_points import segments, snapshot_points
from mlxd.engine.kv.ssd_snapshots import states_from_host
from mlxd.engine.stage_clock import RequestClock
from mlxd.protocol.messages import CacheSource


class PrefixAdmission:
    # the runner's (batch/runner.py), read here
    _gen: BatchGenerator
    rows: RowTable
    cache: PrefixCache
    codec: CacheCodec
    counters: RunnerCounters
    clock: RequestClock
    segmented: bool
    _min_cached: int
    _gpu: bool
    _kv_quant: Any
    _publish: Publisher
    _outbox: queue.Queue[Any]
    _stop_sequences: StopSequences
    # this part's own: prefill groups by name (the answers to one prompt), set by the runner
    _groups: dict[str, PrefillGroup]

    def _admit(self, adds: list[AddRequest]) -> None:
        """Requests that share a long uncached prefix with one still prefilling (the leader)
        wait for it and then hit the cache: N agents with one system prompt prefill it once."""
        if self._groups:
            self._expire_groups()
        floor = lend_floor(len(adds), self._gpu, self._min_cached)
        meet = meeting_points(adds, self.cache.peek) if self.cache.exact and self.segmented \
            else {}
        for add in adds:
            if add.group and add.group_size > 1:
                self._admit_grouped(add)
                continue
            if self.cache.max_bytes:
                lead = self._leader_for(add)
                if lead is not None:
                    lead.followers.append(add)
                    continue
            row = self._insert(add, floor=floor, extra_points=meet.get(add.request_id, ()))
            if self.cache.max_bytes:
                row.prefilling = add.prompt

    def _admit_grouped(self, add: AddRequest) -> None:
        group = self._groups.get(add.group)
        if group is None:  # the first member: it prefills for all
            row = self._insert(add)
            self._groups[add.group] = PrefillGroup(row.uid, [], add.group_size - 1,
                                                   time.monotonic())
            row.leads = add.group
            return
        group.expected -= 1
        if group.expected <= 0 and group.leader is None:
            del self._groups[add.group]
        if group.leader is not None:
            group.waiting.append(add)
        else:
            self._insert(add, group.prefix)

    def _leader_for(self, add: AddRequest) -> Row | None:
        """The prefilling row `add` waits for (`sharing.leader_for`), noting the snapshot
        point it waits for where the cache has state layers."""
        cached = max(self.cache.peek(add.prompt), add.restored.tokens if add.restored else 0)
        found = leader_for(add.prompt, cached, self.rows, self.cache.exact)
        if found is None:
            return None
        row, point = found
        if point:
            row.waits[add.request_id] = point
        return row

    def _release_followers(self, row: Row) -> None:
        row.prefilling = None
        row.waits.clear()
        waiting, row.followers = row.followers, []
        if waiting:
            self._admit(waiting)

    def _share_group_prefix(self, row: Row) -> None:
        """A group leader's prompt is in its cache: its members start from a view of it."""
        name, row.leads = row.leads, ""
        group = self._groups.get(name)
        if group is None:
            return
        group.leader = None
        got = self._gen.extract_cache([row.uid]).get(row.uid)
        waiting, group.waiting = group.waiting, []
        if got is not None:
            cache, tokens = got
            p = row.prompt_len - 1
            snap = (p, row.snaps[p]) if p in row.snaps else None
            group.prefix = shared_prefix(self.codec, cache, list(tokens), snap)
        if group.expected <= 0:
            del self._groups[name]
        for add in waiting:
            self._insert(add, group.prefix)

    def _end_group_leader(self, row: Row) -> None:
        """A leader removed before its prompt was prefilled: its members prefill themselves."""
        group = self._groups.get(row.leads)
        row.leads = ""
        if group is not None:
            group.leader = None
            waiting, group.waiting = group.waiting, []
            for add in waiting:
                self._insert(add)

    def _expire_groups(self) -> None:
        old = time.monotonic() - GROUP_TTL
        for name in [n for n, g in self._groups.items() if g.leader is None and g.created < old]:
            del self._groups[name]

    def _insert(self, add: AddRequest, shared: tuple[Held, list[int]] | None = None,
                floor: int | None = None, extra_points: Any = ()) -> Row:
        """Into the batch, from the best prefix at hand: `shared` (a prefill group's layers
        and its tokens), the SSD tier's restored blocks or the RAM tier's, if of `floor`
        tokens or more (default: the `min_cached_tokens` setting). A model with state layers
        stops at the prompt's snapshot points on the way (`snapshot_points.py`), and at those
        its admission asked for (`AddRequest.snapshot_at`)."""
        prompt = add.prompt
        floor = self._min_cached if floor is None else floor
        cache, cached = None, 0
        source: CacheSource = "none"
        hit = self.cache.lookup(prompt, floor) if self.cache.max_bytes else None
        if shared is not None:
            # as much as the prompts share, and one token at least is always fed
            base, tokens = shared
            common = min(common_prefix(tuple(tokens), tuple(prompt)), len(prompt) - 1)
            if self.codec.has_state and common != base.n:
                common = 0  # a state is usable only where it was taken
            if common > 0 and (hit is None or common > hit.n):
                hit = Held(common, [(kv_slice(k, common), kv_slice(v, common))
                                    for k, v in base.layers], base.states)
        restored = add.restored
        if restored is not None and restored.tokens < floor:
            restored = None
        if restored is not None and (hit is None or restored.tokens > hit.n):
            n, dtype = restored.tokens, restored.dtype
            layers = [(to_mx(k, dtype), to_mx(v, dtype)) for k, v in restored.layers]
            states = states_from_host(restored.states)
            cache, cached, source = self.codec.lend(layers, states, n, self._kv_quant), n, "ssd"
            self.counters.ssd_restored_tokens += n
            entry = self._publish.store(prompt[:n], layers,
                                        {n: states} if self.codec.has_state else {}, kept=True)
            if entry is not None:
                entry.persisted = True  # it came from the SSD tier
        elif hit is not None:
            n = hit.n
            # new cache objects over the stored buffers: the donor entry is never written
            cache, cached, source = self.codec.lend(hit.layers, hit.states, n,
                                                    self._kv_quant), n, "ram"
        points: list[int] = []
        if self.codec.has_state and self.cache.max_bytes and self.segmented:
            points = sorted({*snapshot_points(cached, len(prompt)),
                             *(p for p in (*extra_points, *add.snapshot_at)
                               if cached < p < len(prompt) - 1)})
        self.clock.inserted(add.request_id)
        rows: list[Any] = [segments(prompt, cached, points) if points else prompt[cached:]]
        insert = self._gen.insert_segments if points else self._gen.insert
        uid = insert(
            rows,
            max_tokens=[add.max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[prompt[:cached]] if cached else None,
            samplers=[add.sampler],
            logits_processors=[add.processors],
            stop_sequences=[self._stop_sequences],
        )[0]
        row = Row(uid, add.request_id, len(prompt), add.received_at, time.monotonic(),
                  add.logprobs, cached, max_tokens=add.max_tokens, snap_at=frozenset(points),
                  grammar=next((p for p in add.processors
                                if getattr(p, "budget", None) is not None), None),
                  speculate=add.speculate)
        self.rows.add(row)
        c = self.counters
        c.prompt_tokens += len(prompt)
        c.cached_tokens += cached
        self._outbox.put(RequestStarted(add.request_id, cached, source))
        return row
