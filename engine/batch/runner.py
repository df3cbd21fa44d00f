"""The MLX thread: drives mlx-lm's BatchGenerator with continuous batching.

It does MLX work and little else: it takes commands from its inbox, reuses cached prefixes
(RAM tier, or blocks the I/O thread already read from SSD), runs one generator step, and hands
the step's raw token IDs to the output thread in one queue put.

Admission: a request joins the running rows only while the KV budget (`batch_budget.py`,
`--batch auto` or N) has room for it; the others wait here, in arrival order, until rows
finish. A burst of requests reaching an idle engine within a few milliseconds is gathered into
one insert, so mlx-lm prefills it as one batch rather than one prompt after the other.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences

from mlxd.engine.batch.budget import Budget
from mlxd.engine.batch.kv_gate import KvGate
from mlxd.engine.batch.messages import (
    AbortRequest,
    AddRequest,
    Call,
    RequestsRemoved,
    RequestStarted,
    StepTokens,
    StopRunner,
)
from mlxd.engine.grammar.steps import GrammarSteps
from mlxd.engine.kv import quant as kv_quant
from mlxd.engine.kv.prefix_cache import Entry, PrefixCache, common_prefix
from mlxd.engine.speculative.step import Speculator
from mlxd.protocol import faults, stage_trace

log = logging.getLogger("mlxd.engine")

MIN_SHARED_PREFIX = 32  # tokens two simultaneous prompts must share to prefill them once
# Burst admission: an idle engine that just got a request keeps gathering arrivals while they
# come within BURST_QUIET_S of each other or more are being prepared (template, tokens) on the
# small admission lane, for BURST_WINDOW_S of arrivals at most; requests that reached the engine
# within that window and are still being prepared are waited for up to BURST_PREPARE_S more
# (a small CPU prepares a burst of 32 more slowly than the window: it came out in up to 13
# groups, each one more prefill pass). Then they are prefilled as one batch.
# MLXD_BURST_WINDOW="QUIET_MS,WINDOW_MS[,PREPARE_MS]" sets them, for benchmarks/burst.py.


def _burst_window(value: str) -> tuple[float, float, float]:
    try:
        ms = [float(x) / 1e3 for x in value.split(",")]
        if len(ms) in (2, 3) and all(x >= 0 for x in ms):
            return ms[0], ms[1], ms[2] if len(ms) == 3 else 0.1
    except ValueError:
        pass
    return 0.003, 0.030, 0.1


BURST_QUIET_S, BURST_WINDOW_S, BURST_PREPARE_S = _burst_window(
    os.environ.get("MLXD_BURST_WINDOW", ""))


def _min_cached(value: str) -> int:
    try:
        return max(0, int(value or 0))
    except ValueError:
        return 0


# A cached prefix shorter than this is not used (the row is prefilled whole). 0, the default:
# any hit is used. MLXD_MIN_CACHED_TOKENS sets it, for comparisons (benchmarks/burst.py).
MIN_CACHED_TOKENS = _min_cached(os.environ.get("MLXD_MIN_CACHED_TOKENS", ""))
# Rows admitted together prefill as one padded batch. On a GPU that prefill of short prompts is
# bound by kernel launches more than by the tokens it computes, while a lent prefix costs a
# per-row, per-layer merge into the batch's cache: on the H200, bursts of 32-64 fresh chats,
# each lent the chat template's first ~7 tokens, reached their first tokens 45-100 ms later
# than with those hits not lent, and as late as 3x the in-process reference (RESULTS.md
# section 19). So a GPU lends rows admitted together only hits of this many tokens or more. A
# lone request gets any hit (its merge is one row's), and so does every row on a CPU, whose
# prefill is bound by the tokens it computes.
GROUP_MIN_CACHED_GPU = 64


def lend_floor(rows_admitted: int, gpu: bool) -> int:
    """The shortest cached prefix lent to a row admitted with `rows_admitted - 1` others."""
    if gpu and rows_admitted > 1:
        return max(MIN_CACHED_TOKENS, GROUP_MIN_CACHED_GPU)
    return MIN_CACHED_TOKENS


@dataclass
class PrefillGroup:
    """The rows answering one prompt (OpenAI `n`): the first to arrive prefills it, the others
    wait for its prompt and start from a view of its KV (only the last prompt token is theirs
    to feed). Kept until every member has arrived, or GROUP_TTL passed."""
    leader: int | None  # its uid while its prompt is being prefilled
    waiting: list[AddRequest]
    expected: int  # members still to arrive
    created: float
    prefix: tuple[list[tuple[Any, Any]], list[int]] | None = None  # (KV, tokens) once prefilled


GROUP_TTL = 30.0  # seconds a group waits for members that may never come (aborted meanwhile)


@dataclass
class RunnerCounters:
    steps: int = 0  # advanced by every step: the hang watchdog's progress counter
    peak_batch: int = 0
    prompt_tokens: int = 0
    prefilled_tokens: int = 0
    cached_tokens: int = 0
    ssd_restored_tokens: int = 0
    generated_tokens: int = 0
    checkpoints: int = 0
    checkpoint_s: float = 0.0  # MLX-thread time spent taking checkpoints
    first_tokens: int = 0  # requests that produced their first token (for the means below)
    to_admit_s: float = 0.0  # sum over them: engine receipt -> inserted into the batch
    to_first_token_s: float = 0.0  # sum over them: engine receipt -> first token sampled
    step_s: float = 0.0  # MLX-thread time in generation steps, checkpoints included
    active: int = 0
    busy: bool = False
    batch_cap: int = 0  # rows the budget allows now (see batch_budget.explain)
    batch_why: str = ""
    waiting: int = 0  # requests held back until rows finish
    bursts: int = 0  # inserts of two or more requests gathered together while idle


class Runner:
    def __init__(self, model: Any, eos_ids: list[int], *, batch_size: int, prefill_step: int,
                 outbox: queue.Queue[Any], stream: Any = None, cache_bytes: int = 0,
                 persist: Callable[[list[Entry]], Any] | None = None,
                 on_evict: Callable[[Entry], None] | None = None,
                 checkpoint_every: int = 0,
                 budget: Budget | None = None, context: int = 0,
                 preparing: Callable[[float], int] | None = None,
                 speculator: Speculator | None = None) -> None:
        """`batch_size`: the most rows the generator holds; `budget` (None: no memory rule)
        decides which requests join the running rows; `preparing(t)` counts requests that
        reached the engine by monotonic time t and are still being prepared for this runner
        (burst admission waits for them); `persist(entries)` queues KV entries' blocks for
        the SSD tier (new RAM entries, checkpoints)."""
        self._model = model
        self.spec = speculator  # speculative steps for a row decoding alone
        self._grammar = GrammarSteps()  # constrained rows: masks computed together
        self._batch_size = batch_size
        self.gate = KvGate(batch_size, budget, context)  # who joins the running rows, when
        self._preparing = preparing or (lambda submitted_by: 0)
        self._prefill_step = prefill_step
        self._stream = stream
        self._stop_sequences = StopSequences([[e] for e in eos_ids])
        self.inbox: queue.Queue[Any] = queue.Queue()
        self._outbox = outbox
        self._uid_to_rid: dict[int, str] = {}
        self._rid_to_uid: dict[str, int] = {}
        self._followers: dict[int, list[AddRequest]] = {}  # leader uid -> waiting requests
        self._prefilling: dict[int, list[int]] = {}  # uid -> prompt, until its prompt is done
        self.counters = RunnerCounters()
        cacheable = kv_quant.cacheable(model)  # plain or quantized KV (--kv-bits)
        self._kv_quant = kv_quant.config_of(model)
        self._gpu = mx.default_device() == mx.gpu  # see GROUP_MIN_CACHED_GPU
        self.cache = PrefixCache(cache_bytes if cacheable else 0, on_evict=on_evict)
        self._persist = persist
        self._to_persist: list[Entry] = []  # this step's new RAM entries, persisted at its end
        self._checkpoint_every = checkpoint_every if persist else 0
        self._generated: dict[int, int] = {}  # uid -> tokens generated, for checkpoints
        self._prompt_len: dict[int, int] = {}  # uid -> prompt tokens, for the prompt boundary
        self._awaiting_first: dict[int, tuple[float, float]] = {}  # uid -> (received, admitted)
        self._logprobs: dict[int, int] = {}  # uid -> top alternatives wanted
        self._groups: dict[str, PrefillGroup] = {}
        self._group_leaders: dict[int, str] = {}  # uid -> group, while its prompt prefills
        self._gen = self._new_generator()
        self._update_cap()

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self._model,
            completion_batch_size=self._batch_size,
            prefill_batch_size=self._batch_size,
            prefill_step_size=self._prefill_step,
            stream=self._stream,
        )

    def run(self) -> None:
        # Every MLX op of the loop in the generator's stream: made on the thread's default
        # stream, the cache tiers' views of a lent prefix were each a cross-stream input of
        # the prefill (benchmarks/burst_runner.py, RESULTS.md section 19).
        with mx.stream(self._gen.stream):
            self._loop()

    def _loop(self) -> None:
        try:
            while self._handle_commands(block=not self._uid_to_rid):
                if self._uid_to_rid:
                    self.step()
                if self.gate.held and self.gate.room_changed:  # rows ended: room for more?
                    self._admit(self._through_gate([]))
        finally:
            self._gen.close()

    # ------------------------------------------------------------------ commands

    def _handle_commands(self, block: bool) -> bool:
        if not block and not self.inbox.queue:  # the usual step: no lock taken, no Empty raised
            return True
        try:
            cmd = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return True
        adds: list[AddRequest] = []
        aborts: list[str] = []
        while True:
            if not self._take(cmd, adds, aborts):
                return False
            try:
                cmd = self.inbox.get_nowait()
            except queue.Empty:
                break
        if adds and not self._uid_to_rid and not self._gather_burst(adds, aborts):
            return False
        if aborts:
            if "*" in aborts:  # every request: running, waiting for a leader, held, just added
                aborts = [*self._rid_to_uid, *(a.request_id for w in self._followers.values()
                                               for a in w),
                          *(a.request_id for g in self._groups.values() for a in g.waiting),
                          *(a.request_id for a in self.gate.held),
                          *(a.request_id for a in adds)]
            gone = set(aborts)
            adds = [a for a in adds if a.request_id not in gone]  # aborted before it started
            self._abort(aborts)
        if adds or self.gate.held:
            admitted = self._through_gate(adds)
            if len(admitted) > 1 and not self._uid_to_rid:
                self.counters.bursts += 1
            self._admit(admitted)
        self.counters.active = len(self._uid_to_rid)
        self.counters.busy = bool(self._uid_to_rid)
        return True

    def _take(self, cmd: Any, adds: list[AddRequest], aborts: list[str]) -> bool:
        """One command; False once the runner must stop."""
        match cmd:
            case StopRunner():
                self.gate.held.extend(adds)  # failed with the rest
                self._fail_all("engine stopping")
                return False
            case AddRequest():
                if stage_trace.ON:
                    stage_trace.stamp_request(cmd.request_id, "taken", "engine")
                adds.append(cmd)
            case AbortRequest(request_id=rid):
                aborts.append(rid)
            case Call(fn=fn):
                fn(self)
        return True

    def _gather_burst(self, adds: list[AddRequest], aborts: list[str]) -> bool:
        """An idle engine got a request: gather the burst behind it (see BURST_QUIET_S), so
        that it is prefilled as one batch. False on StopRunner."""
        window_end = time.monotonic() + BURST_WINDOW_S
        hard_end = window_end + BURST_PREPARE_S
        while (now := time.monotonic()) < hard_end:
            if now >= window_end and not self._preparing(window_end):
                break  # the window's arrivals are all here
            try:
                cmd = self.inbox.get(timeout=min(BURST_QUIET_S, hard_end - now))
            except queue.Empty:
                if not self._preparing(min(time.monotonic(), window_end)):
                    break  # quiet, and nothing of the burst still being prepared
                continue
            if not self._take(cmd, adds, aborts):
                return False
        while True:  # what a lane handed over between the last look and the count
            try:
                cmd = self.inbox.get_nowait()
            except queue.Empty:
                return True
            if not self._take(cmd, adds, aborts):
                return False

    # ------------------------------------------------------------------ the KV budget

    def _through_gate(self, adds: list[AddRequest]) -> list[AddRequest]:
        admitted = self.gate.admit(adds)
        self._update_cap()
        return admitted

    def _release(self, rids: list[str]) -> None:
        self.gate.release(rids)
        self._update_cap()

    def _update_cap(self) -> None:
        c = self.counters
        c.waiting = len(self.gate.held)
        c.batch_cap, c.batch_why = self.gate.cap()

    def set_budget(self, b: Budget) -> None:
        """A new KV budget (the engine's memory share changed; run through `Call`, on the MLX
        thread). Running rows go on; the gate admits no row that does not fit the new budget,
        so a smaller one holds new rows back until enough running ones end; a larger one lets
        held rows in at once. The RAM prefix cache takes its new capacity now, and memory MLX
        kept for reuse goes back to the system (another engine may be about to load)."""
        old = self.gate.budget
        shrunk = b.kv_bytes + b.cache_bytes < (
            old.kv_bytes + self.cache.max_bytes if old else 0)
        self.gate.set_budget(b)
        if kv_quant.cacheable(self._model):
            self.cache.resize(b.cache_bytes)
        if shrunk:
            mx.clear_cache()
        self._update_cap()

    def _admit(self, adds: list[AddRequest]) -> None:
        """Requests that share a long uncached prefix with one still prefilling (the leader)
        wait for it and then hit the cache: N agents with one system prompt prefill it once."""
        if self._groups:
            self._expire_groups()
        floor = lend_floor(len(adds), self._gpu)
        for add in adds:
            if add.group and add.group_size > 1:
                self._admit_grouped(add)
                continue
            if self.cache.max_bytes:
                lead = self._leader_for(add)
                if lead is not None:
                    self._followers.setdefault(lead, []).append(add)
                    continue
            uid = self._insert(add, floor=floor)
            if self.cache.max_bytes:
                self._prefilling[uid] = add.prompt

    def _admit_grouped(self, add: AddRequest) -> None:
        group = self._groups.get(add.group)
        if group is None:  # the first member: it prefills for all
            uid = self._insert(add)
            self._groups[add.group] = PrefillGroup(uid, [], add.group_size - 1,
                                                   time.monotonic())
            self._group_leaders[uid] = add.group
            return
        group.expected -= 1
        if group.expected <= 0 and group.leader is None:
            del self._groups[add.group]
        if group.leader is not None:
            group.waiting.append(add)
        else:
            self._insert(add, group.prefix)

    def _share_group_prefix(self, uid: int) -> None:
        """A group leader's prompt is in its cache: its members start from a view of it."""
        name = self._group_leaders.pop(uid)
        group = self._groups.get(name)
        if group is None:
            return
        group.leader = None
        got = self._gen.extract_cache([uid]).get(uid)
        waiting, group.waiting = group.waiting, []
        if got is not None:
            cache, tokens = got
            held = kv_quant.cache_layers(cache, len(tokens))
            if held is not None:
                group.prefix = (held[0], list(tokens[:held[1]]))
        if group.expected <= 0:
            del self._groups[name]
        for add in waiting:
            self._insert(add, group.prefix)

    def _end_group_leader(self, uid: int) -> None:
        """A leader removed before its prompt was prefilled: its members prefill themselves."""
        group = self._groups.get(self._group_leaders.pop(uid, ""))
        if group is not None:
            group.leader = None
            waiting, group.waiting = group.waiting, []
            for add in waiting:
                self._insert(add)

    def _expire_groups(self) -> None:
        old = time.monotonic() - GROUP_TTL
        for name in [n for n, g in self._groups.items() if g.leader is None and g.created < old]:
            del self._groups[name]

    def _leader_for(self, add: AddRequest) -> int | None:
        """A prefilling request sharing MIN_SHARED_PREFIX tokens beyond what the caches give
        `add` already (one slice comparison per candidate, at C speed)."""
        cached = max(self.cache.peek(add.prompt), add.restored.tokens if add.restored else 0)
        need = cached + MIN_SHARED_PREFIX
        if need >= len(add.prompt):
            return None
        head = add.prompt[:need]
        return next((uid for uid, p in self._prefilling.items() if p[:need] == head), None)

    def _insert(self, add: AddRequest,
                shared: tuple[list[tuple[Any, Any]], list[int]] | None = None,
                floor: int | None = None) -> int:
        """Into the batch, from the best prefix at hand: `shared` (a prefill group's KV and
        its tokens), the SSD tier's restored blocks or the RAM tier's, if of `floor` tokens
        or more (default: MIN_CACHED_TOKENS)."""
        prompt = add.prompt
        floor = MIN_CACHED_TOKENS if floor is None else floor
        cache, cached, source = None, 0, "none"
        hit = self.cache.lookup(prompt, floor) if self.cache.max_bytes else None
        if shared is not None:
            # as much as the prompts share, and one token at least is always fed
            common = min(common_prefix(tuple(shared[1]), tuple(prompt)), len(prompt) - 1)
            if common > 0 and (hit is None or common > hit[1]):
                hit = (shared[0], common)
        restored = add.restored
        if restored is not None and restored.tokens < floor:
            restored = None
        if restored is not None and (hit is None or restored.tokens > hit[1]):
            n, dtype = restored.tokens, restored.dtype
            layers = [(kv_quant.to_mx(k, dtype), kv_quant.to_mx(v, dtype))
                      for k, v in restored.layers]
            cache, cached, source = self._lend(layers, n, self._kv_quant), n, "ssd"
            self.counters.ssd_restored_tokens += n
            entry = self.cache.insert(prompt[:n], layers, kv_quant.kv_nbytes(layers))
            if entry is not None:
                entry.persisted = True  # it came from the SSD tier
        elif hit is not None:
            layers, n = hit
            cache, cached, source = self._lend(layers, n, self._kv_quant), n, "ram"
        if stage_trace.ON:
            stage_trace.stamp_request(add.request_id, "inserted", "engine", True)
        uid = self._gen.insert(
            [prompt[cached:]],
            max_tokens=[add.max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[prompt[:cached]] if cached else None,
            samplers=[add.sampler],
            logits_processors=[add.processors],
            stop_sequences=[self._stop_sequences],
        )[0]
        self._uid_to_rid[uid] = add.request_id
        self._rid_to_uid[add.request_id] = uid
        self._prompt_len[uid] = len(prompt)
        if add.logprobs >= 0:
            self._logprobs[uid] = add.logprobs
        self._awaiting_first[uid] = (add.received_at, time.monotonic())
        c = self.counters
        c.prompt_tokens += len(prompt)
        c.cached_tokens += cached
        c.prefilled_tokens += len(prompt) - cached
        self._outbox.put(RequestStarted(add.request_id, cached, source))
        return uid

    @staticmethod
    def _lend(layers: list[tuple[Any, Any]], n: int,
              quant: tuple[int, int] | None = None) -> list[Any]:
        """New cache objects over the stored buffers: the donor entry is never written."""
        return kv_quant.lend(layers, n, quant)

    def _abort(self, rids: list[str]) -> None:
        gone = set(rids)
        if stage_trace.ON:  # those not inserted yet never reach their last stamp
            for rid in rids:
                stage_trace.forget_request(rid)
        for waiting in [*self._followers.values(), *(g.waiting for g in self._groups.values())]:
            waiting[:] = [a for a in waiting if a.request_id not in gone]
        self.gate.drop_held(gone)
        self._release(rids)
        uids = [self._rid_to_uid.pop(r) for r in rids if r in self._rid_to_uid]
        for uid in uids:
            del self._uid_to_rid[uid]
            if uid in self._group_leaders:
                self._end_group_leader(uid)
            self._generated.pop(uid, None)
            self._awaiting_first.pop(uid, None)
            self._logprobs.pop(uid, None)
        if uids:
            caches = self._gen.remove(uids, return_prompt_caches=bool(self.cache.max_bytes))
            for uid in uids:
                self._release_followers(uid)
                prompt_len = self._prompt_len.pop(uid, 0)
                if uid in caches:
                    cache, tokens = caches[uid]
                    self._publish(tokens, cache, prompt_len)
        self._outbox.put(RequestsRemoved(rids))
        self._persist_new_entries()

    def _release_followers(self, uid: int) -> None:
        self._prefilling.pop(uid, None)
        waiting = self._followers.pop(uid, None)
        if waiting:
            self._admit(waiting)

    # ------------------------------------------------------------------ steps

    def step(self) -> None:
        t0 = time.perf_counter()
        try:
            self._generate()
            self._persist_new_entries()  # after the step's tokens went out
        finally:
            self.counters.step_s += time.perf_counter() - t0

    def _generate(self) -> None:
        faults.hit("engine.step")
        try:
            with self._grammar.step(self._gen):
                prompt_responses, responses = (self._gen.next() if self.spec is None else
                                               self.spec.next(self._gen, self._logprobs))
        except Exception as e:  # a failed step must not take the engine down
            log.exception("generation step failed; failing its requests")
            self._fail_all(f"generation step failed: {e}", held=False)
            self._gen.close()
            self._gen = self._new_generator()
            return
        c = self.counters
        c.steps += 1
        if self._group_leaders:
            for pr in prompt_responses:
                if pr.end_of_prompt and pr.uid in self._group_leaders:
                    self._share_group_prefix(pr.uid)
        if self._prefilling:
            for pr in prompt_responses:
                if pr.end_of_prompt and self._prefilling.pop(pr.uid, None) is not None \
                        and pr.uid in self._followers:
                    self._publish_prompt(pr.uid)
        if not responses:
            return
        rows = []
        due = []
        finished: list[str] = []
        logprobs = self._logprobs_of(responses) if self._logprobs else None
        if self._awaiting_first:
            now = time.monotonic()
            for r in responses:
                times = self._awaiting_first.pop(r.uid, None)
                if times is not None and times[0]:
                    c.first_tokens += 1
                    c.to_admit_s += times[1] - times[0]
                    c.to_first_token_s += now - times[0]
        for r in responses:
            rid = self._uid_to_rid.get(r.uid)
            if rid is None:
                continue
            rows.append((rid, r.token, r.finish_reason))
            if self._checkpoint_every and r.finish_reason is None:
                n = self._generated.get(r.uid, 0) + 1
                self._generated[r.uid] = n
                if n % self._checkpoint_every == 0:
                    due.append(r.uid)
            if r.finish_reason is not None:
                self._generated.pop(r.uid, None)
                self._logprobs.pop(r.uid, None)
                del self._uid_to_rid[r.uid]
                del self._rid_to_uid[rid]
                finished.append(rid)
                self._release_followers(r.uid)
                prompt_len = self._prompt_len.pop(r.uid, 0)
                if r.prompt_cache is not None and self.cache.max_bytes:
                    self._publish(r.all_tokens, r.prompt_cache, prompt_len)
        if finished:
            self._release(finished)
        if due:
            t0 = time.perf_counter()
            self._checkpoint(due)
            c.checkpoint_s += time.perf_counter() - t0
        c.generated_tokens += len(rows)
        c.peak_batch = max(c.peak_batch, len({r.uid for r in responses}))
        c.active = len(self._uid_to_rid)
        c.busy = bool(self._uid_to_rid)
        self._outbox.put(StepTokens(rows, logprobs))

    def _persist_new_entries(self) -> None:
        """The step's new RAM entries to the SSD tier in one call, after its tokens are out."""
        if self._to_persist:
            entries, self._to_persist = self._to_persist, []
            assert self._persist is not None
            self._persist(entries)

    def _logprobs_of(self, responses: list[Any]) -> dict[str, tuple[float, list]]:
        """Chosen-token and top-k log-probabilities for the rows that asked, in one evaluation
        (the vectors are already computed; this reads a few numbers of each)."""
        wanted = [(r, self._logprobs[r.uid]) for r in responses
                  if r.uid in self._logprobs and r.uid in self._uid_to_rid]
        if not wanted:
            return {}
        k = max(1, max(n for _, n in wanted))
        lp = mx.stack([r.logprobs.reshape(-1) for r, _ in wanted])
        chosen = mx.take_along_axis(lp, mx.array([[r.token] for r, _ in wanted]), axis=-1)
        part = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
        part_lp = mx.take_along_axis(lp, part, axis=-1)
        order = mx.argsort(-part_lp, axis=-1)
        top_ids = mx.take_along_axis(part, order, axis=-1)
        top_lp = mx.take_along_axis(part_lp, order, axis=-1)
        mx.eval(chosen, top_ids, top_lp)
        # tolist() of 2-D arrays: nested lists (its annotation covers every rank)
        chosen_l = cast(list[list[float]], chosen.tolist())
        ids_l = cast(list[list[int]], top_ids.tolist())
        lps_l = cast(list[list[float]], top_lp.tolist())
        return {self._uid_to_rid[r.uid]:
                (chosen_l[i][0], list(zip(ids_l[i][:n], lps_l[i][:n], strict=True)))
                for i, (r, n) in enumerate(wanted)}

    def _checkpoint(self, uids: list[int]) -> None:
        """--generation-checkpoint: a running request's boundary (prompt and generated so far)
        goes to the SSD tier only (not RAM: it is still live here). Only blocks the disk lacks
        are copied."""
        assert self._persist is not None  # without it checkpoint_every is 0, never called
        entries = []
        for cache, tokens in self._gen.extract_cache(uids).values():
            held = kv_quant.cache_layers(cache, len(tokens))
            if held is None:
                continue
            layers, n = held
            entries.append(Entry(tuple(tokens[:n]), layers, 0))
        self._persist(entries)
        self.counters.checkpoints += len(entries)

    def _publish_prompt(self, uid: int) -> None:
        """A leader's prompt is in its cache: store that boundary, admit its followers."""
        got = self._gen.extract_cache([uid]).get(uid)
        if got is not None:
            cache, tokens = got
            self._publish(list(tokens), cache)
        self._release_followers(uid)

    def _publish(self, tokens: list[int], cache: list[Any], prompt_len: int = 0) -> None:
        """A request's history into the RAM tier; to the SSD tier both the history and the
        prompt boundary (a tail block ending with the prompt), so that repeating the same prompt
        after a restart is served whole, not just its full blocks."""
        held = kv_quant.cache_layers(cache, len(tokens)) if tokens else None
        if held is None:
            return
        layers, n = held
        entry = self.cache.insert(list(tokens[:n]), layers, kv_quant.kv_nbytes(layers))
        if self._persist is None:
            return
        if entry is not None and not entry.persisted:
            self._to_persist.append(entry)
        # One token short of the prompt: a lookup uses at most len(prompt) - 1 tokens (one is
        # always fed), so this is the boundary the same prompt, repeated, can use whole.
        cut = prompt_len - 1
        if 0 < cut < n:
            boundary = [(kv_quant.kv_slice(k, cut), kv_quant.kv_slice(v, cut))
                        for k, v in layers]
            self._to_persist.append(Entry(tuple(tokens[:cut]), boundary, 0))

    def _fail_all(self, message: str, held: bool = True) -> None:
        """Every request ends with `message`; those held back for room too unless `held` is
        False (a failed step: they never ran, and are admitted into the rebuilt generator)."""
        rids = list(self._rid_to_uid)
        waiting = [a.request_id for w in self._followers.values() for a in w]
        self._followers.clear()
        self._prefilling.clear()
        self._prompt_len.clear()
        self._awaiting_first.clear()
        self._logprobs.clear()
        waiting += [a.request_id for g in self._groups.values() for a in g.waiting]
        waiting += self.gate.clear(held)
        self._groups.clear()
        self._group_leaders.clear()
        self._update_cap()
        if self._uid_to_rid:
            self._gen.remove(list(self._uid_to_rid))
        self._uid_to_rid.clear()
        self._rid_to_uid.clear()
        self.counters.active = 0
        self.counters.busy = False
        if stage_trace.ON:
            for rid in waiting:
                stage_trace.forget_request(rid)
        if rids or waiting:
            self._outbox.put(RequestsRemoved(rids + waiting, error=message))
