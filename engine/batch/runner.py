"""The MLX thread: drives mlx-lm's BatchGenerator with continuous batching.

It does MLX work and little else: it takes commands from its inbox, reuses cached prefixes
(RAM tier, or blocks an admission lane already read from SSD), runs one generator step, and
hands the step's raw token IDs to the output thread in one queue put. What it knows of each
row is one `rows.Row`.

Admission: a request joins the running rows only while the KV budget (`budget.py`, `--batch
auto` or N) has room for it; the others wait, in arrival order, until rows finish. A burst of
requests reaching an idle engine within a few milliseconds is gathered into one insert
(`burst.py`), so mlx-lm prefills it as one batch rather than one prompt after the other.
Requests that share a long uncached prefix with one still prefilling wait for it and then hit
the cache; the answers to one prompt (`n`) share its prefill (`admission/prefixes.py`, a part
of this class).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences

from mlxd.engine import stage_clock as step_clock
from mlxd.engine.batch import prefill_apart
from mlxd.engine.batch.admission.prefixes import PrefixAdmission
from mlxd.engine.batch.budget import Budget
from mlxd.engine.batch.burst import BurstWindow
from mlxd.engine.batch.counters import RunnerCounters
from mlxd.engine.batch.kv_gate import KvGate
from mlxd.engine.batch.logprobs import TopLogprobs, top_logprobs
from mlxd.engine.batch.messages import (
    AbortRequest,
    AddRequest,
    Call,
    RequestsRemoved,
    StepTokens,
    StopRunner,
)
from mlxd.engine.batch.publish import Publisher
from mlxd.engine.batch.rows import PrefillGroup, Row, RowTable
from mlxd.engine.batch.sizing import weight_bytes
from mlxd.engine.batch.step_tokens import StepRead, early, first_tokens, read_responses
from mlxd.engine.batch.timing.chunking import PrefillChunks
from mlxd.engine.batch.timing.pace import StepPace
from mlxd.engine.grammar.steps import GrammarSteps
from mlxd.engine.kv import quant as kv_quant
from mlxd.engine.kv.codec import CacheCodec
from mlxd.engine.kv.keep_policy import continues
from mlxd.engine.kv.prefix_cache import Entry, PrefixCache
from mlxd.engine.kv.snapshot_points import PERSIST_MIN
from mlxd.engine.last_token_fold import chunk_limit, row_may_fold
from mlxd.engine.load import cuda_attention
from mlxd.engine.mlx_lm_internals import (
    decoding_rows,
    enable_fold,
    folding,
    prefilled_tokens,
    prompt_contexts,
    prompts_waiting,
    reorder_waiting,
    sampled_tokens,
    set_prefill_step,
    start_ended_prompts,
    start_folded,
    unpadded_batch_masks,
)
from mlxd.engine.speculative.step import Speculator
from mlxd.engine.stage_clock import NO_CLOCK, RequestClock, step_log
from mlxd.protocol import faults, heap, stage_trace
from mlxd.protocol.settings import TuningSettings

log = logging.getLogger("mlxd.engine")
IDLE_S = 0.5  # seconds without a command (no row running) after which the runner is idle


class Runner(PrefixAdmission):
    # whether rows may stop at prompt snapshot points (a sharded group's generator replays
    # plain inserts only: it snapshots histories' ends alone), whether the prefill chunk
    # follows the step time (`chunking.py`; a group's ranks must chunk alike), and whether
    # `--prompt-cache auto` may size the RAM tier from the memory (a group's followers size
    # their stores before it is measured)
    segmented = True
    adaptive_chunks = True
    auto_cache = True

    def __init__(self, model: Any, eos_ids: list[int], *, batch_size: int, prefill_step: int,
                 outbox: queue.Queue[Any], stream: Any = None, cache_bytes: int = 0,
                 persist: Callable[[list[Entry]], Any] | None = None,
                 on_evict: Callable[[Entry], None] | None = None,
                 checkpoint_every: int = 0,
                 budget: Budget | None = None, context: int = 0,
                 preparing: Callable[[float], int] | None = None,
                 speculator: Speculator | None = None,
                 tuning: TuningSettings | None = None,
                 clock: RequestClock = NO_CLOCK, step_target_s: float = 0.0,
                 token_s: float | None = None) -> None:
        """`batch_size`: the most rows the generator holds; `budget` (None: no memory rule)
        decides which requests join the running rows; `preparing(t)` counts requests that
        reached the engine by monotonic time t and are still being prepared for this runner
        (burst admission waits for them); `persist(entries)` queues KV entries' blocks for
        the SSD tier (new RAM entries, checkpoints); `tuning`: the hidden switches (burst
        window, shortest prefix lent, grammar order), read once; `step_target_s` (> 0): the
        seconds a prefilling step should last at most (`chunking.py`); `token_s`: seconds per
        prompt token measured before (the warm-up's), the first step's guide (`pace.py`)."""
        tuning = tuning or TuningSettings()
        self._model = model
        self.spec = speculator  # speculative steps for a row decoding alone
        self._grammar = GrammarSteps(tuning.grammar_order == "fill-first")
        self._burst = BurstWindow.parse(tuning.burst_window)
        self._min_cached = tuning.min_cached_tokens
        self._unpadded_masks = tuning.batch_masks == "unpadded"
        self._prefill_alone_from = tuning.prefill_alone_from
        self._early_first = tuning.early_first_token
        layers = getattr(model, "layers", None)
        self._fold = tuning.fold_last_token if tuning.fold_last_token >= 0 else chunk_limit(
            mx.default_device() == mx.gpu, len(layers) if layers is not None else 1)
        self._heap_trim = tuning.heap_trim
        self.clock = clock
        self._steps = step_log() if clock is not NO_CLOCK else None  # the stage clock's
        self._batch_size = batch_size
        self.gate = KvGate(batch_size, budget, context)  # who joins the running rows, when
        self._preparing = preparing or (lambda submitted_by: 0)
        self._prefill_step = prefill_step
        self._chunks = PrefillChunks(prefill_step, step_target_s, token_s=token_s) \
            if step_target_s > 0 and self.adaptive_chunks else None
        self._pace = StepPace(token_s)  # how long steps take now: the hang watchdog's patience
        self._stream = stream
        self._stop_sequences = StopSequences([[e] for e in eos_ids])
        self._eos = frozenset(eos_ids)
        self.inbox: queue.Queue[Any] = queue.Queue()
        self._outbox = outbox
        self.rows = RowTable()
        self.counters = RunnerCounters()
        self.codec = CacheCodec.for_model(model)  # what the tiers can hold of its cache
        self.weights_bytes = weight_bytes(model)
        if not self.codec.supported:
            log.warning("no KV cache tiers for this model: mlxd cannot hold its cache "
                        "class %s", self.codec.unsupported)
        self._kv_quant = kv_quant.config_of(model)
        self._gpu = mx.default_device() == mx.gpu  # see burst.lend_floor
        self.cache = PrefixCache(cache_bytes if self.codec.supported else 0,
                                 on_evict=on_evict, exact=self.codec.has_state)
        self._publish = Publisher(self.cache, self.codec, persist)
        self._checkpoint_every = checkpoint_every if persist else 0
        self._groups: dict[str, PrefillGroup] = {}
        self._stepped = False  # a step ran since MLX's buffers were last given back
        self._next_done = 0.0  # when the last step's generator call returned
        self._moved = (0, 0)  # (stage clock) when ended prompts were last moved to generation
        # Work of the engine's own between generation steps (its embedding passes): one piece a
        # turn of the loop, after the step, while `_between_due`; True from it while more is left.
        self.between: Callable[[], bool] | None = None
        self._between_due = False
        cuda_attention.install(model)
        self._gen = self._new_generator()
        if type(self._gen) is not BatchGenerator:
            self._fold = 0  # a sharded group's leader: its followers replay its calls, not this
        if self._fold:
            enable_fold(model)
        self._update_cap()

    def _new_generator(self) -> BatchGenerator:
        if self._unpadded_masks:
            unpadded_batch_masks()
        gen = BatchGenerator(
            self._model,
            completion_batch_size=self._batch_size,
            prefill_batch_size=self._batch_size,
            prefill_step_size=self._prefill_step,
            stream=self._stream,
        )
        if self._chunks is not None:
            set_prefill_step(gen, self._chunks.chunk)
        return gen

    def run(self) -> None:
        # Every MLX op of the loop in the generator's stream: the cache tiers' views of a lent
        # prefix are then made on the stream that prefills with them (not cross-stream inputs,
        # which slow a burst's prefill: benchmarks/RESULTS.md, "Burst prefill with short
        # cached prefixes").
        with mx.stream(self._gen.stream):
            self._loop()

    def _loop(self) -> None:
        try:
            while self._handle_commands(block=not self.rows and not self._between_due):
                self.turn_tail()
        finally:
            self._gen.close()

    def turn_tail(self) -> None:
        """What follows the commands in a turn of the loop: a step if rows run, then held
        requests admitted if rows finished."""
        if self.rows:
            self.step()
        if self._between_due and self.between is not None:
            self._between_due = self.between()
            self._stepped = True
        if self.gate.held and self.gate.room_changed:  # rows ended: room for more?
            self._admit(self._through_gate([]))

    def wake_between(self) -> None:
        """`between` has work (run through `Call`, on the MLX thread)."""
        self._between_due = True

    def _release_idle_memory(self) -> None:
        """Nothing to run for `IDLE_S`: the buffers MLX keeps for reuse (a long prefill's
        peak) and the C heap's free pages (`heap.give_back_free_heap`) go back to the system,
        once per busy spell. An idle daemon must not hold them: on a Mac they are the
        machine's RAM, on a shared GPU another process's memory. The RAM prefix cache's
        entries are data, not buffers: they stay."""
        if self._stepped:
            mx.clear_cache()
            if self._heap_trim:
                heap.give_back_free_heap()
            self._stepped = False

    def take_commands(self) -> bool:
        """Take whatever is in the inbox without waiting (drivers: tests, benchmarks); False
        once the runner must stop."""
        return self._handle_commands(block=False)

    # ------------------------------------------------------------------ commands

    def _handle_commands(self, block: bool) -> bool:
        if not block and not self.inbox.queue:  # the usual step: no lock taken, no Empty raised
            return True
        try:
            cmd = self.inbox.get(timeout=IDLE_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            if block:
                self._release_idle_memory()
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
        if adds and not self.rows and not self._gather_burst(adds, aborts):
            return False
        if aborts:
            if "*" in aborts:  # every request: running, waiting for a leader, held, just added
                aborts = [*self.rows.request_ids(), *self.waiting_ids(held=True),
                          *(a.request_id for a in adds)]
            gone = set(aborts)
            adds = [a for a in adds if a.request_id not in gone]  # aborted before it started
            self._abort(aborts)
        if adds or self.gate.held:
            admitted = self._through_gate(adds)
            if len(admitted) > 1 and not self.rows:
                self.counters.bursts += 1
            self._admit(admitted)
        self._count_rows()
        return True

    def _take(self, cmd: Any, adds: list[AddRequest], aborts: list[str]) -> bool:
        """One command; False once the runner must stop."""
        match cmd:
            case StopRunner():
                self.gate.held.extend(adds)  # failed with the rest
                self._fail_all("engine stopping")
                return False
            case AddRequest():
                self.clock.taken(cmd.request_id)
                adds.append(cmd)
            case AbortRequest(request_id=rid):
                aborts.append(rid)
            case Call(fn=fn):
                fn(self)
        return True

    def _gather_burst(self, adds: list[AddRequest], aborts: list[str]) -> bool:
        """An idle engine got a request: gather the burst behind it (`burst.py`), so that it
        is prefilled as one batch. False on StopRunner."""
        burst = self._burst
        window_end = time.monotonic() + burst.window
        hard_end = window_end + burst.prepare
        while (now := time.monotonic()) < hard_end:
            if now >= window_end and not self._preparing(window_end):
                break  # the window's arrivals are all here
            try:
                cmd = self.inbox.get(timeout=min(burst.quiet, hard_end - now))
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

    def waiting_ids(self, held: bool) -> list[str]:
        """Requests not running: waiting for a leader's prompt or a prefill group's, and
        (`held`) held back for room."""
        out = [a.request_id for row in self.rows for a in row.followers]
        out += [a.request_id for g in self._groups.values() for a in g.waiting]
        if held:
            out += [a.request_id for a in self.gate.held]
        return out

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

    def _count_rows(self) -> None:
        self.counters.active = len(self.rows)
        self.counters.busy = bool(self.rows)

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
        if self.codec.supported:
            self.cache.resize(b.cache_bytes)
        if shrunk:
            mx.clear_cache()
        self._update_cap()

    # ------------------------------------------------------------------ admission

    def _abort(self, rids: list[str]) -> None:
        gone = set(rids)
        self.clock.forget(rids)  # those not inserted yet never reach their last stamp
        for waiting in [*(row.followers for row in self.rows),
                        *(g.waiting for g in self._groups.values())]:
            waiting[:] = [a for a in waiting if a.request_id not in gone]
        self.gate.drop_held(gone)
        self._release(rids)
        ended = [row for r in rids if (row := self.rows.by_request(r)) is not None]
        for row in ended:
            self.rows.pop(row.uid)
            if row.leads:
                self._end_group_leader(row)
        if ended:
            caches = self._gen.remove([row.uid for row in ended],
                                      return_prompt_caches=bool(self.cache.max_bytes))
            for row in ended:
                self._release_followers(row)
                if row.uid in caches:
                    cache, tokens = caches[row.uid]
                    self._publish.history(tokens, cache, row.prompt_len, row.snaps)
        self._outbox.put(RequestsRemoved(rids))
        self._publish.hand_over()

    # ------------------------------------------------------------------ steps

    def step(self) -> None:
        """One generation step (drivers may call it directly: tests, benchmarks)."""
        t0 = time.perf_counter()
        self._stepped = True
        if self._prefill_alone_from:
            self._prefill_alone()
        gen = self._gen
        before = prefilled_tokens(gen)
        waiting = prompts_waiting(gen)
        if self._chunks is not None:
            set_prefill_step(gen, self._chunks.for_step(decoding_rows(gen) > 0, waiting))
        self.counters.pace_s = self._pace.starting(gen.prefill_step_size * waiting)
        if self._steps is not None:
            self._trace_step(t0, before)
            return
        try:
            self._generate()
            self._publish.hand_over()  # after the step's tokens went out
        finally:
            self._step_ended(before, time.perf_counter() - t0)

    def _step_ended(self, before: int, dt: float) -> int:
        """A step that began with the generator's prefill counter at `before` took `dt`: the
        chunk and the pace learn from it. The prompt tokens it prefilled."""
        c = self.counters
        c.step_s += dt
        c.longest_step_s = max(c.longest_step_s, dt)
        # (a rebuilt generator counts from 0: nothing to learn)
        prefilled = max(0, prefilled_tokens(self._gen) - before)
        c.prefilled_tokens += prefilled  # as computed: a prompt given up mid-way counts its part
        if self._chunks is not None and prefilled > 0:
            self._chunks.observe(prefilled, dt)
        self._pace.ended(dt, prefilled)
        return prefilled

    def _prefill_alone(self) -> None:
        """The setting `prefill_alone_from`: prompts over a long context are prefilled apart
        from each other, short ones join the batch at once (`prefill_apart.py`)."""
        gen = self._gen
        prefilling, waiting = prompt_contexts(gen)
        order, size = prefill_apart.plan(prefilling, waiting, self._prefill_alone_from,
                                         self._batch_size)
        reorder_waiting(gen, order)
        gen.prefill_batch_size = size

    def _trace_step(self, t0: float, before: int) -> None:
        """`step` under the stage clock: the same, and its record in the step log."""
        assert self._steps is not None
        routed = dict(cuda_attention.COUNTS)
        made = self.counters.generated_tokens
        rec: dict[str, Any] = {"t": time.perf_counter_ns(), "dec": decoding_rows(self._gen),
                               "wait": prompts_waiting(self._gen),
                               "chunk": self._gen.prefill_step_size}
        t1 = t0
        try:
            self._generate()
            t1 = time.perf_counter()
            self._publish.hand_over()
        finally:
            t2 = time.perf_counter()
            prefilled = self._step_ended(before, t2 - t0)
            rec.update(next_ms=round((self._next_done - t0) * 1e3, 3),
                       gen_ms=round((t1 - t0) * 1e3, 3), hand_ms=round((t2 - t1) * 1e3, 3),
                       pre=prefilled, tok=self.counters.generated_tokens - made,
                       **{k: v - routed[k] for k, v in
                                         cuda_attention.COUNTS.items() if v != routed[k]})
            self._steps.record(rec)

    def _generate(self) -> None:
        faults.hit("engine.step")
        try:
            fold = folding(self._gen, self._may_fold, self._fold) if self._fold \
                else nullcontext()
            with self._grammar.step(self._gen), fold:
                prompt_responses, responses = (self._gen.next() if self.spec is None else
                                               self.spec.next(self._gen, self.rows.plain_uids))
            folded = start_folded(self._gen) if self._fold else []
            self._next_done = time.perf_counter()
            ended = self._prompts_stepped(prompt_responses) + self._prompts_stepped(folded)
            if self._early_first:  # after the snapshots: they are taken where a segment ends
                moved_at = stage_trace.now() if self._steps is not None else 0
                ended += self._prompts_stepped(start_ended_prompts(self._gen))
                self._moved = (moved_at, stage_trace.now() if moved_at else 0)
        except Exception as e:  # a failed step must not take the engine down
            log.exception("generation step failed; failing its requests")
            self._step_failed(e)
            return
        c = self.counters
        c.steps += 1
        read = StepRead()
        if ended and self._early_first:
            try:
                self._send_first_tokens(ended, read)
            except Exception as e:  # (the read waits for the device: a failed pass shows here)
                log.exception("generation step failed; failing its requests")
                self._step_failed(e)
                return
        if not responses and not read.tokens:
            return
        read_responses(responses, self.rows, self._checkpoint_every, read)
        now = time.monotonic()
        for row in read.first:
            self._count_first_token(row, now)
        finished = [row.request_id for row, _ in read.ended]
        for row, r in read.ended:
            self._release_followers(row)
            if r.prompt_cache is not None and self.cache.max_bytes:
                self._publish.history(r.all_tokens, r.prompt_cache, row.prompt_len, row.snaps,
                                      kept=continues(row.started_from, row.prompt_len))
        logprobs: dict[str, TopLogprobs] | None = \
            top_logprobs(read.wanted) if read.wanted else None
        if finished:
            self._release(finished)
        if read.due:
            t0 = time.perf_counter()
            c.checkpoints += self._publish.checkpoints(
                list(self._gen.extract_cache(read.due).values()))
            c.checkpoint_s += time.perf_counter() - t0
        c.generated_tokens += len(read.tokens)
        c.peak_batch = max(c.peak_batch, len({r.uid for r in responses}))
        self._count_rows()
        if read.tokens:  # (none when every row's token was one sent a step earlier)
            self._outbox.put(StepTokens(read.tokens, logprobs))

    def _may_fold(self, uid: int) -> bool:
        """Whether a row's last token may be fed in its final chunk's pass
        (`last_token_fold.py`)."""
        row = self.rows.get(uid)
        return row is not None and row_may_fold(row.prompt_len, row.snap_at)

    def _step_failed(self, e: Exception) -> None:
        """A failed step must not take the engine down: its requests fail, the generator is
        made anew."""
        self._fail_all(f"generation step failed: {e}", held=False)
        self._gen.close()
        self._gen = self._new_generator()

    def _prompts_stepped(self, responses: list[Any]) -> list[Row]:
        """What a step's prompt responses call for: snapshots where a segment ended, the
        prompt published where one ended (those rows returned)."""
        ended: list[Row] = []
        for pr in responses:
            if not pr.end_of_segment or (row := self.rows.get(pr.uid)) is None:
                continue
            if not pr.end_of_prompt:
                if row.snap_at:
                    self._take_snapshot(row)
                continue
            ended.append(row)
            self.counters.prefilled_tokens += 1  # its last token, fed as generation starts
            if self._publish.persist is not None and not self.codec.has_state \
                    and row.prompt_len >= PERSIST_MIN:
                self._persist_prompt(row)
            if row.leads:
                self._share_group_prefix(row)
            if row.prefilling is not None:
                row.prefilling = None
                if row.followers:
                    self._publish_prompt(row)
        return ended

    def _send_first_tokens(self, ended: list[Row], read: StepRead) -> None:
        """The first tokens of rows whose prompt ended in this step, into `read` now rather
        than a step later, when mlx-lm's `next()` returns them (`sampled_tokens`): a request's
        first token then waits for its own forward passes only, not for the next decode step
        and the prompt chunks beside it (which rows' tokens may go early: `step_tokens.py`)."""
        uids = [r.uid for r in ended if early(r)]
        if not uids:
            return
        first_tokens(ended, sampled_tokens(self._gen, uids), self._eos, read)
        if read.tokens and self._steps is not None:
            step_clock.first_tokens_read(*self._moved)

    def _count_first_token(self, row: Row, now: float) -> None:
        if row.received_at:
            c = self.counters
            c.first_tokens += 1
            c.to_admit_s += row.admitted_at - row.received_at
            c.to_first_token_s += now - row.received_at

    def _persist_prompt(self, row: Row) -> None:
        """A long prompt's KV to the SSD tier as its prefill ends (`PERSIST_MIN`): what a
        resumed request restarts from if the engine dies while it generates. Blocks the disk
        holds already cost nothing: the arrays are copied only for blocks it lacks."""
        got = self._gen.extract_cache([row.uid]).get(row.uid)
        if got is not None:
            self._publish.prompt_point(list(got[1]), got[0])

    def _take_snapshot(self, row: Row) -> None:
        """The row stopped at the end of a prompt segment: the state layers' snapshot, if it
        is one of its points (`snapshot_points.py`)."""
        got = self._gen.extract_cache([row.uid]).get(row.uid)
        if got is None:
            return
        cache, tokens = got
        p = len(tokens)
        if p not in row.snap_at:
            return
        held = self._publish.prompt_point(list(tokens), cache)
        if held is None:
            return
        row.snaps[p] = held.states
        waiting = [a for a in row.followers if row.waits.get(a.request_id) == p]
        if waiting:  # requests that part ways with it here start from this snapshot
            self._publish.store(list(tokens), held.layers, {p: held.states})
            row.followers = [a for a in row.followers if a not in waiting]
            for a in waiting:
                del row.waits[a.request_id]
            self._admit(waiting)

    def _publish_prompt(self, row: Row) -> None:
        """A leader's prompt is in its cache: store that boundary, admit its followers."""
        got = self._gen.extract_cache([row.uid]).get(row.uid)
        if got is not None:
            cache, tokens = got
            self._publish.history(list(tokens), cache)
        self._release_followers(row)

    def _fail_all(self, message: str, held: bool = True) -> None:
        """Every request ends with `message`; those held back for room too unless `held` is
        False (a failed step: they never ran, and are admitted into the rebuilt generator)."""
        rids = self.rows.request_ids()
        waiting = self.waiting_ids(held=False)
        waiting += self.gate.clear(held)
        self._groups.clear()
        self._update_cap()
        if self.rows:
            self._gen.remove(self.rows.uids())
        self.rows.clear()
        self._count_rows()
        self.clock.forget(waiting)
        if rids or waiting:
            self._outbox.put(RequestsRemoved(rids + waiting, error=message))
