"""Speculative decoding, the MLX part: a step of mlx-lm's BatchGenerator that drafts tokens
(prompt lookup or a draft model) and verifies them in one forward pass of the target, in the
spirit of mlx-lm's `speculative_generate_step`: for a row decoding alone, and for several rows
decoding together (each with its own drafts and its own accepted count, one verify pass).

It works on the generator's own state rather than beside it, through mlx-lm's one door
(`mlx_lm_internals.RunningBatch`): the lone row's KV cache (a `BatchKVCache` of one row,
trimmed back past the last accepted token), its token history, stop matcher, token count,
and the token it has sampled but not yet fed. So a speculative step leaves the generator
exactly as the same number of plain steps would have, and plain steps continue from it
whenever the batch grows: a request arriving mid-way waits for one step at most.

Rows never speculated: those with logits processors (penalties, grammars: each position
would need the context of the drafts before it), those asking for log-probabilities, and a
sampler whose per-position key (engine/admit/sampling.py) cannot be rewound. A row whose
model has sliding-window or recurrent layers is put back after a rejected draft by
`rewind.py` (restored and fed the accepted tokens again), never by a trim those layers cannot
do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from mlxd.engine.mlx_lm_internals import (
    RunningBatch,
    decoding_alone,
    decoding_only,
    decoding_rows,
    device_async_eval,
    device_eval,
    running_batch,
)
from mlxd.engine.speculative.draft_rows import DraftRows, batchable
from mlxd.engine.speculative.policy import NgramIndex, SpecCounters, SpecPolicy, accepted
from mlxd.engine.speculative.rewind import Rewind, needs_rewind, speculable

Draw = Callable[[mx.array, int], mx.array]
# Rows decoding together speculate only up to this many: a verify pass leaves rows that
# accepted different counts padded, so every later step of the batch attends with an array
# mask; at 32 rows of ordinary chat one such pass cost the rest of the run 17 % on the CPU
# (benchmarks/RESULTS.md, "Speculative decoding"), where a few rows gain from drafts.
ROWS_MAX = 8


class NgramDrafter:
    """Prompt lookup over the row's whole context (prompt and generated tokens)."""

    def __init__(self) -> None:
        self._key: object = None
        self._index = NgramIndex()

    def _sync(self, key: object, history: list[int]) -> NgramIndex:
        idx = self._index
        if key != self._key or len(idx.tokens) > len(history):
            idx = self._index = NgramIndex()
            self._key = key
        # the index may hold the then-unfed token, which history now has at that place
        idx.extend(history[len(idx.tokens):])
        return idx

    def likely(self, key: object, history: list[int]) -> bool:
        """Before waiting for the row's unfed token: the context up to it ends with tokens
        that occurred before (a stretch that repeats). If not, the step stays plain and
        asynchronous, as mlx-lm's pipelined steps are, at no cost."""
        return bool(self._sync(key, history).propose(1))

    def propose(self, key: object, history: list[int], last: int, k: int,
                draw: Draw) -> list[int]:
        idx = self._sync(key, history)
        idx.extend([last])
        return idx.propose(k)


class DraftModelDrafter:
    """A smaller model with the target's vocabulary drafts greedily from its own KV cache,
    kept in step with the row's context (trimmed to what the target accepted)."""

    def __init__(self, model: Any, prefill_step: int) -> None:
        self.model, self.prefill_step = model, prefill_step
        self._key: object = None
        self._cache: list[Any] = []
        self._tokens: list[int] = []  # in the draft cache
        self._synced = 0  # _tokens[:_synced] is known to equal the row's context
        self.catch_up_s = 0.0  # the last proposal's time feeding a context it had not seen

    def propose(self, key: object, history: list[int], last: int, k: int,
                draw: Draw) -> list[int]:
        """`draw(logits, j)`: the token the target's sampler would draw from `logits` at the
        j-th verified position (greedy, or the seeded key of that position), so that a draft
        model like the target proposes what the target will sample."""
        if key != self._key:
            self._key, self._cache, self._tokens, self._synced = (
                key, make_prompt_cache(self.model), [], 0)
        context = [*history, last]
        n = min(self._synced, len(context))
        limit = min(len(self._tokens), len(context))
        while n < limit and self._tokens[n] == context[n]:
            n += 1
        n = min(n, len(context) - 1)  # one token is always fed: its logits draft the first
        if len(self._tokens) > n:
            trim_prompt_cache(self._cache, len(self._tokens) - n)
            del self._tokens[n:]
        feed = context[n:]
        t0 = time.perf_counter()
        while len(feed) > 2:  # a new row's context (a one-off, like a prefill): apart
            step = min(len(feed) - 1, self.prefill_step)
            self.model(mx.array([feed[:step]]), cache=self._cache)
            device_eval([c.state for c in self._cache])
            self._tokens += feed[:step]
            feed = feed[step:]
        self.catch_up_s = time.perf_counter() - t0
        logits = self.model(mx.array([feed]), cache=self._cache)[:, -1]
        self._tokens += feed
        self._synced = len(context)
        y = draw(logits, 0)
        drafts = [y]
        for j in range(1, k):
            y = draw(self.model(y[:, None], cache=self._cache)[:, -1], j)
            device_async_eval(y)
            drafts.append(y)
        out = cast(list[int], mx.concatenate(drafts).tolist())  # 1-D: a list of ints
        self._tokens += out[:-1]  # the last draft was never fed
        return out


def sampler_position(sampler: Callable[..., Any]) -> list[int] | None:
    """The one-item list holding a seeded sampler's next position (engine/admit/sampling.py's
    closure), so that positions sampled beyond the accepted drafts are given back."""
    code = getattr(sampler, "__code__", None)
    cells = getattr(sampler, "__closure__", None)
    if code is None or not cells or "position" not in code.co_freevars:
        return None
    cell = cells[code.co_freevars.index("position")].cell_contents
    return cell if isinstance(cell, list) and len(cell) == 1 and isinstance(cell[0], int) \
        else None


class Speculator:
    """The runner's step: `next(gen, exclude)` in place of `gen.next()`. A row decoding alone
    speculates on its own (`_speculate`, any cache kind); several rows decoding together
    speculate in one verify pass (`_speculate_rows`, plain KV layers), each row with its own
    drafter and its own accepted count. Each case has its own policy: a token of a lone row
    and a token of a batch cost differently."""

    def __init__(self, num_draft: int, draft_model: Any = None, prefill_step: int = 512) -> None:
        self.mode = "draft" if draft_model is not None else "ngram"
        self.policy = SpecPolicy(num_draft, adaptive=draft_model is not None)
        self.rows_policy = SpecPolicy(num_draft, adaptive=draft_model is not None,
                                      counters=self.policy.counters)
        self._draft_model, self._prefill_step = draft_model, prefill_step
        self.drafter = self._new_drafter()
        # several rows' drafts from one batched draft cache (plain KV draft models)
        self.draft_rows = DraftRows(draft_model, prefill_step) \
            if draft_model is not None and batchable(draft_model) else None
        self._row_drafters: dict[int, NgramDrafter | DraftModelDrafter] = {}
        self._prev = ""  # this or the previous step: "spec", "lone" (plain, one row), "rows"
        # (plain, several rows that could have speculated), "miss" (waited for the unfed
        # token, no draft) or "other"

    def _new_drafter(self) -> NgramDrafter | DraftModelDrafter:
        return (DraftModelDrafter(self._draft_model, self._prefill_step)
                if self._draft_model is not None else NgramDrafter())

    @property
    def counters(self) -> SpecCounters:
        return self.policy.counters

    def next(self, gen: Any, exclude: Container[int]) -> tuple[list[Any], list[Any]]:
        batch = self._lone_row(gen, exclude)
        if batch is not None:
            out = self._speculate(gen, batch)  # None: a plain step; `_prev` "miss" if it synced
            if out is not None:
                self._prev = "spec"
                return [], out
        rows = None if batch is not None else self._rows(gen, exclude)
        if self.draft_rows is not None and decoding_rows(gen) < 2:
            self.draft_rows.clear()
        if rows is not None:
            out = self._speculate_rows(gen, rows)
            if out is not None:
                self._prev = "spec"
                return [], out
        alone = decoding_alone(gen)
        n = 0 if rows is None else len(rows)  # before the step: finished rows leave the batch
        t0 = time.perf_counter()
        result = gen.next()
        dt = time.perf_counter() - t0
        if alone:
            self.policy.record_plain(dt if self._prev == "lone" else None)
        elif n:
            self.rows_policy.record_plain(dt / n if self._prev == "rows" else None)
        self._prev = "lone" if alone else "rows" if rows is not None else "other"
        return result

    def _lone_row(self, gen: Any, exclude: Container[int]) -> RunningBatch | None:
        if not decoding_alone(gen):
            return None
        batch = running_batch(gen)
        if batch is None or batch.uids[0] in exclude or batch.processors[0]:
            return None
        if not speculable(batch.cache):
            return None
        sampler = batch.sampler(0)
        if sampler is not greedy_sampler and sampler_position(sampler) is None:
            return None
        return batch

    def _rows(self, gen: Any, exclude: Container[int]) -> RunningBatch | None:
        """Several rows decoding (at most ROWS_MAX), nothing prefilling, every row one that may
        speculate, every layer plain KV (whose rows `advance_rows` cuts back each to its own
        length)."""
        if not decoding_only(gen):
            return None
        batch = running_batch(gen)
        if batch is None or not 2 <= len(batch) <= ROWS_MAX or any(batch.processors):
            return None
        if any(u in exclude for u in batch.uids):
            return None
        if not all(type(c) is BatchKVCache for c in batch.cache):
            return None
        for i in range(len(batch)):
            sampler = batch.sampler(i)
            if sampler is not greedy_sampler and sampler_position(sampler) is None:
                return None
        return batch

    def _row_drafter(self, uid: int) -> NgramDrafter | DraftModelDrafter:
        drafter = self._row_drafters.get(uid)
        if drafter is None:
            drafter = self._row_drafters[uid] = self._new_drafter()
        return drafter

    def _speculate_rows(self, gen: Any, batch: RunningBatch) -> list[Any] | None:
        """Each row drafts its own tokens (prompt lookup per row; a draft model for all rows
        in one batched pass per drafted position, `DraftRows`); one forward pass of the
        target verifies every row's drafts (rows with fewer, or none, filled up to the
        longest: their extra positions are dropped as rejected drafts are); each row keeps
        what its own sampler confirms."""
        uids = batch.uids
        for gone in [u for u in self._row_drafters if u not in uids]:
            del self._row_drafters[gone]
        remaining = [batch.remaining(i) for i in range(len(batch))]
        k = self.rows_policy.draft_len(max(remaining))
        if k <= 0:
            return None
        drafters = [] if self.draft_rows is not None else [self._row_drafter(u) for u in uids]
        # every row's index brought up to date here, outside the step's timing (a new row's
        # is built over its whole context once): not `any`, which would stop at the first
        if self.mode == "ngram" and not any([
                cast(NgramDrafter, d).likely((id(gen), u), batch.history(i))
                for i, (d, u) in enumerate(zip(drafters, uids, strict=True))]):
            return None
        with mx.stream(gen.stream):
            device_eval(batch.pending)  # the previous step's work ends here, not in our timing
            t0 = time.perf_counter()
            lasts = cast(list[int], batch.pending.tolist())
            positions: list[tuple[list[int] | None, int]] = []
            draws: list[Draw | None] = []
            for i in range(len(uids)):
                sampler = batch.sampler(i)
                position = None if sampler is greedy_sampler else sampler_position(sampler)
                draw, start = _drawer(sampler, position)
                positions.append((position, start))
                draws.append(None if position is None else draw)
            rooms = [min(k, r - 1) for r in remaining]
            if self.draft_rows is not None:
                proposed = self.draft_rows.propose(
                    [(id(gen), u) for u in uids], [batch.history(i) for i in range(len(uids))],
                    lasts, max(rooms), draws)
                drafts = [got[:room] if room > 0 else []
                          for got, room in zip(proposed, rooms, strict=True)]
            else:
                drafts = [drafter.propose((id(gen), uid), batch.history(i), lasts[i], room,
                                          draw or _greedy_draw)[:room] if room > 0 else []
                          for i, (drafter, uid, room, draw) in enumerate(
                              zip(drafters, uids, rooms, draws, strict=True))]
            for position, start in positions:
                if position is not None:
                    position[0] = start
            width = max(len(d) for d in drafts)
            if width == 0:
                self.rows_policy.record_miss()
                self._prev = "miss"
                return None
            fed = [[last, *d, *[last] * (width - len(d))] for last, d in zip(lasts, drafts,
                                                                             strict=True)]
            logits = batch.model(mx.array(fed, dtype=mx.uint32), cache=batch.cache)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            greedy = mx.argmax(logprobs, axis=-1)
            picks: list[Any] = []
            for i, (position, _) in enumerate(positions):
                n = len(drafts[i]) + 1
                picks.append(greedy[i, :n] if position is None else mx.concatenate(
                    [batch.sampler(i)(logprobs[i, j:j + 1]) for j in range(n)]))
            device_eval(picks, logprobs)
            rows: list[tuple[list[int], list[Any], Any]] = []
            nexts: list[int] = []
            accepted_total = 0
            for i, (pick, (position, start)) in enumerate(zip(picks, positions, strict=True)):
                sampled = cast(list[int], pick.tolist())
                n = accepted(drafts[i], sampled)
                accepted_total += n
                if position is not None:
                    position[0] = start + n + 1  # the draws past the accepted ones never happened
                rows.append(([lasts[i], *drafts[i][:n]],
                             [batch.pending_logprobs(i), *(logprobs[i, j] for j in range(n))],
                             logprobs[i, n]))
                nexts.append(sampled[n])
            out = batch.advance_rows(rows, width + 1,
                                     mx.array(nexts, dtype=batch.pending.dtype))
        catch_up = self.draft_rows.catch_up_s if self.draft_rows is not None else sum(
            getattr(d, "catch_up_s", 0.0) for d in drafters)
        self.rows_policy.record_spec(time.perf_counter() - t0 - catch_up,
                                     sum(len(d) for d in drafts), accepted_total, len(out),
                                     rows=len(rows))
        return out

    def _speculate(self, gen: Any, batch: RunningBatch) -> list[Any] | None:
        k = self.policy.draft_len(batch.remaining(0))
        if k <= 0:
            return None
        sampler = batch.sampler(0)
        position = None if sampler is greedy_sampler else sampler_position(sampler)
        if isinstance(self.drafter, NgramDrafter) and not self.drafter.likely(
                (id(gen), batch.uids[0]), batch.history(0)):
            return None
        with mx.stream(gen.stream):
            device_eval(batch.pending)  # the previous step's work ends here, not in our timing
            t0 = time.perf_counter()
            last = int(batch.pending.item())
            uid = batch.uids[0]
            draw, start = _drawer(sampler, position)
            drafts = self.drafter.propose((id(gen), uid), batch.history(0), last, k, draw)[:k]
            if position is not None:
                position[0] = start
            if not drafts:
                self.policy.record_miss()
                self._prev = "miss"  # the plain step that follows waits on no device work
                return None
            k = len(drafts)
            rewind = Rewind(batch.model, batch.cache, [last, *drafts]) \
                if needs_rewind(batch.cache) else None
            logits = batch.model(mx.array([[last, *drafts]], dtype=mx.uint32),
                                 cache=batch.cache)[0]
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            if position is None:
                sampled = sampler(logprobs)  # greedy: every position in one call
            else:
                sampled = mx.concatenate([sampler(logprobs[j:j + 1]) for j in range(k + 1)])
            device_eval(sampled, logprobs)
            n = accepted(drafts, cast(list[int], sampled.tolist()))
            if position is not None:
                position[0] = start + n + 1  # the draws past the accepted ones never happened
            out = batch.advance_alone([last, *drafts[:n]],
                                      [batch.pending_logprobs(0),
                                       *(logprobs[j] for j in range(n))],
                                      k, sampled[n:n + 1], logprobs[n], rewind)
        catch_up = getattr(self.drafter, "catch_up_s", 0.0)  # a one-off: not the step's cost
        self.policy.record_spec(time.perf_counter() - t0 - catch_up, k, n, len(out))
        return out


def _greedy_draw(logits: mx.array, j: int) -> mx.array:
    return mx.argmax(logits, axis=-1)


def _drawer(sampler: Callable[..., Any], position: list[int] | None) -> tuple[Draw, int]:
    """How a draft model draws its j-th token: as the target will sample that position."""
    if position is None:
        return _greedy_draw, 0
    start = position[0]

    def draw(logits: mx.array, j: int) -> mx.array:
        position[0] = start + j
        return cast(mx.array, sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True)))
    return draw, start
