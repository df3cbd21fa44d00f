"""Speculative decoding, the MLX part: a step of mlx-lm's BatchGenerator that, for a row
decoding alone, drafts tokens (prompt lookup or a draft model) and verifies them in one
forward pass of the target, in the spirit of mlx-lm's `speculative_generate_step`.

It works on the generator's own state rather than beside it: the lone row's KV cache (a
`BatchKVCache` of one row, trimmed back with `trim_prompt_cache` past the last accepted
token), its token history, stop matcher, token count, and the token it has sampled but not
yet fed (`_next_tokens`). So a speculative step leaves the generator exactly as the same
number of plain steps would have, and plain steps continue from it whenever the batch grows:
a request arriving mid-way waits for one step at most. mlx-lm 0.32's `BatchGenerator`
internals are read here (`_generation_batch`, `_prompt_batch`, `_unprocessed_sequences`);
pyproject pins mlx-lm below 0.33.

Rows never speculated: those with logits processors (penalties, grammars: each position
would need the context of the drafts before it), those asking for log-probabilities, and a
sampler whose per-position key (engine/sampling.py) cannot be rewound.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from mlxd.engine.speculative.policy import NgramIndex, SpecCounters, SpecPolicy, accepted

Draw = Callable[[mx.array, int], mx.array]


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
            mx.eval([c.state for c in self._cache])
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
            mx.async_eval(y)
            drafts.append(y)
        out = cast(list[int], mx.concatenate(drafts).tolist())  # 1-D: a list of ints
        self._tokens += out[:-1]  # the last draft was never fed
        return out


def sampler_position(sampler: Callable[..., Any]) -> list[int] | None:
    """The one-item list holding a seeded sampler's next position (engine/sampling.py's
    closure), so that positions sampled beyond the accepted drafts are given back."""
    code = getattr(sampler, "__code__", None)
    cells = getattr(sampler, "__closure__", None)
    if code is None or not cells or "position" not in code.co_freevars:
        return None
    cell = cells[code.co_freevars.index("position")].cell_contents
    return cell if isinstance(cell, list) and len(cell) == 1 and isinstance(cell[0], int) \
        else None


class Speculator:
    """The runner's step: `next(gen, exclude)` in place of `gen.next()`."""

    def __init__(self, num_draft: int, draft_model: Any = None, prefill_step: int = 512) -> None:
        self.mode = "draft" if draft_model is not None else "ngram"
        self.policy = SpecPolicy(num_draft, adaptive=draft_model is not None)
        self.drafter: NgramDrafter | DraftModelDrafter = (
            DraftModelDrafter(draft_model, prefill_step) if draft_model is not None
            else NgramDrafter())
        self._prev = ""  # this or the previous step: "spec", "lone" (plain, one row), "miss"
        # (waited for the unfed token, no draft) or "other"

    @property
    def counters(self) -> SpecCounters:
        return self.policy.counters

    def next(self, gen: Any, exclude: Container[int]) -> tuple[list[Any], list[Any]]:
        gb = self._lone_row(gen, exclude)
        if gb is not None:
            out = self._speculate(gen, gb)  # None: a plain step; `_prev` "miss" if it synced
            if out is not None:
                self._prev = "spec"
                return [], out
        alone = _alone(gen)
        t0 = time.perf_counter()
        result = gen.next()
        if alone:
            dt = time.perf_counter() - t0
            self.policy.record_plain(dt if self._prev == "lone" else None)
        self._prev = "lone" if alone else "other"
        return result

    def _lone_row(self, gen: Any, exclude: Container[int]) -> Any:
        if not _alone(gen):
            return None
        gb = gen._generation_batch
        if gb.uids[0] in exclude or (gb.logits_processors and gb.logits_processors[0]):
            return None
        if not all(type(c) is BatchKVCache for c in gb.prompt_cache):
            return None
        sampler = (gb.samplers[0] if gb.samplers else None) or gb.fallback_sampler
        if sampler is not greedy_sampler and sampler_position(sampler) is None:
            return None
        return gb

    def _speculate(self, gen: Any, gb: Any) -> list[Any] | None:
        k = self.policy.draft_len(gb.max_tokens[0] - gb._num_tokens[0])
        if k <= 0:
            return None
        sampler = (gb.samplers[0] if gb.samplers else None) or gb.fallback_sampler
        position = None if sampler is greedy_sampler else sampler_position(sampler)
        if isinstance(self.drafter, NgramDrafter) and not self.drafter.likely(
                (id(gen), gb.uids[0]), gb.tokens[0]):
            return None
        with mx.stream(gen.stream):
            mx.eval(gb._next_tokens)  # the previous step's work ends here, not in our timing
            t0 = time.perf_counter()
            last = int(gb._next_tokens.item())
            uid = gb.uids[0]
            draw, start = _drawer(sampler, position)
            drafts = self.drafter.propose((id(gen), uid), gb.tokens[0], last, k, draw)[:k]
            if position is not None:
                position[0] = start
            if not drafts:
                self.policy.record_miss()
                self._prev = "miss"  # the plain step that follows waits on no device work
                return None
            k = len(drafts)
            logits = gb.model(mx.array([[last, *drafts]], dtype=mx.uint32),
                              cache=gb.prompt_cache)[0]
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            if position is None:
                sampled = sampler(logprobs)  # greedy: every position in one call
            else:
                sampled = mx.concatenate([sampler(logprobs[j:j + 1]) for j in range(k + 1)])
            mx.eval(sampled, logprobs)
            n = accepted(drafts, cast(list[int], sampled.tolist()))
            if position is not None:
                position[0] = start + n + 1  # the draws past the accepted ones never happened
            out = self._emit(gen, gb, uid, [last, *drafts[:n]],
                             [gb._next_logprobs[0], *(logprobs[j] for j in range(n))],
                             k, sampled[n:n + 1], logprobs[n])
        catch_up = getattr(self.drafter, "catch_up_s", 0.0)  # a one-off: not the step's cost
        self.policy.record_spec(time.perf_counter() - t0 - catch_up, k, n, len(out))
        return out

    @staticmethod
    def _emit(gen: Any, gb: Any, uid: int, tokens: list[int], logprobs: list[Any],
              drafted: int, next_token: mx.array, next_logprobs: mx.array) -> list[Any]:
        """Account the produced tokens as plain steps would (count, stop matcher, finish),
        trim the cache to them, and leave the next sampled token to be fed."""
        finish = None
        produced = 0
        for t in tokens:
            produced += 1
            gb._num_tokens[0] += 1
            if gb._num_tokens[0] >= gb.max_tokens[0]:
                finish = "length"
            if gb._matchers[0].advance(t):
                finish = "stop"
            if finish is not None:
                break
        tokens = tokens[:produced]
        trim_prompt_cache(gb.prompt_cache, drafted + 1 - produced)
        gb.tokens[0].extend(tokens)
        gen._counters.generation_tokens += produced
        gen._counters.generation_steps += 1
        Response = type(gb).Response
        out = [Response(uid, t, lp, None, None, None)
               for t, lp in zip(tokens[:-1], logprobs, strict=False)]
        if finish is not None:
            out.append(Response(uid, tokens[-1], logprobs[produced - 1], finish,
                                gb.extract_cache(0), gb.tokens[0]))
            gb.filter([])
        else:
            out.append(Response(uid, tokens[-1], logprobs[produced - 1], None, None, None))
            gb._next_tokens = next_token
            gb._next_logprobs = [next_logprobs]
        return out


def _drawer(sampler: Callable[..., Any], position: list[int] | None) -> tuple[Draw, int]:
    """How a draft model draws its j-th token: as the target will sample that position."""
    if position is None:
        return (lambda logits, j: mx.argmax(logits, axis=-1)), 0
    start = position[0]

    def draw(logits: mx.array, j: int) -> mx.array:
        position[0] = start + j
        return cast(mx.array, sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True)))
    return draw, start


def _alone(gen: Any) -> bool:
    """One row decoding and no prompt waiting or being prefilled."""
    return (len(gen._generation_batch) == 1 and len(gen._prompt_batch) == 0
            and not gen._unprocessed_sequences)
