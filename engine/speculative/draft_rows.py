"""A draft model drafting for several rows at once: one batched KV cache of the draft model
for the rows speculating together, one forward pass of it per drafted position for all of
them, where one draft cache per row would cost a pass per row and position.

Ownership: the Speculator's engine thread only. The cache's rows are kept in the order of
the target batch's rows (`keys`); a row's cache holds a prefix of that row's context
(`_tokens[i]`), trimmed back to what the target accepted before the next draft.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from mlxd.engine.mlx_lm_internals import cut_rows_back, device_async_eval, device_eval

# row i's sampler at its j-th verified position; None: greedy (one argmax for all rows)
Draw = Callable[[mx.array, int], mx.array] | None


def batchable(model: Any) -> bool:
    """Every layer of the draft model is a plain KV cache (what `BatchKVCache` batches)."""
    return all(type(c) is KVCache for c in make_prompt_cache(model))


def _common(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n


class DraftRows:
    """Drafts `k` tokens for each row of a batch in `k` passes of the draft model over all the
    rows (plus catch-up passes: a row new to the cache is prefilled on its own, once; rows
    behind by the same number of plain steps are caught up together)."""

    def __init__(self, model: Any, prefill_step: int) -> None:
        self.model, self.prefill_step = model, prefill_step
        self.keys: list[object] = []  # one per row of the cache, in the target batch's order
        self._cache: list[BatchKVCache] = []
        self._tokens: list[list[int]] = []
        self.catch_up_s = 0.0  # the last proposal's time feeding context it had not seen
        self.passes = 0  # forward passes of the draft model (figures and tests)

    def clear(self) -> None:
        """Let the rows' draft cache go (no rows speculating together now)."""
        if self.keys:
            self.keys, self._cache, self._tokens = [], [], []

    def _forward(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        self.passes += 1
        return cast(mx.array, self.model(tokens, cache=cache))

    def _prefilled(self, context: list[int]) -> list[Any]:
        """A new row's cache holding all of its context but the last token, fed in chunks."""
        cache = make_prompt_cache(self.model)
        feed = context[:-1]
        for at in range(0, len(feed), self.prefill_step):
            self._forward(mx.array([feed[at:at + self.prefill_step]]), cache)
            device_eval([c.state for c in cache])
        return cache

    def _align(self, keys: Sequence[object], contexts: list[list[int]]) -> None:
        """The cache's rows made those of `keys`, in that order: rows gone are dropped, rows
        kept reordered, new rows prefilled on their own and merged in."""
        if keys == self.keys:
            return
        old = {k: i for i, k in enumerate(self.keys)}
        per_layer: list[list[KVCache]] = []
        tokens: list[list[int]] = []
        for key, context in zip(keys, contexts, strict=True):
            i = old.get(key)
            if i is not None and self._tokens[i]:
                row: list[Any] = [c.extract(i) for c in self._cache]
                kept = self._tokens[i]
            else:
                row, kept = self._prefilled(context), context[:-1]
            per_layer = per_layer or [[] for _ in row]
            for layer, c in zip(per_layer, row, strict=True):
                layer.append(c)
            tokens.append(list(kept))
        self._cache = [BatchKVCache.merge(layer) for layer in per_layer]
        self._tokens = tokens
        self.keys = list(keys)

    def _cut_back(self, drop: list[int]) -> None:
        """Row i loses its last `drop[i]` positions (as the target's rows after a verify)."""
        cut_rows_back(self._cache, drop)
        for toks, d in zip(self._tokens, drop, strict=True):
            if d:
                del toks[len(toks) - d:]

    def propose(self, keys: Sequence[object], histories: list[list[int]], lasts: list[int], k: int,
                draws: list[Draw]) -> list[list[int]]:
        """`k` drafts for each row: `draws[i](logits, j)` is the token row i's sampler would
        draw at its j-th verified position. The rows' contexts are `histories[i] + [lasts[i]]`."""
        t0 = time.perf_counter()
        contexts = [[*h, last] for h, last in zip(histories, lasts, strict=True)]
        self._align(keys, contexts)
        # each row keeps the longest prefix it shares with its context, short of the last
        # token (whose logits draft the first); all rows then feed the same count
        kept = [_common(t, c, min(len(t), len(c) - 1))
                for t, c in zip(self._tokens, contexts, strict=True)]
        width = max(len(c) - n for c, n in zip(contexts, kept, strict=True))
        if width > min(len(c) for c in contexts):  # a short row cannot feed that many
            self.keys = []
            self._align(keys, contexts)
            width = 1
        self._cut_back([len(t) - (len(c) - width)
                        for t, c in zip(self._tokens, contexts, strict=True)])
        while width > 2:  # rows behind after plain steps: caught up together, untimed
            step = min(width - 1, self.prefill_step)
            self._forward(mx.array([c[len(c) - width:len(c) - width + step] for c in contexts]),
                          self._cache)
            device_eval([c.state for c in self._cache])
            width -= step
        self.catch_up_s = time.perf_counter() - t0
        for toks, c in zip(self._tokens, contexts, strict=True):
            toks[:] = c

        def draw_all(logits: mx.array, j: int) -> mx.array:
            if all(d is None for d in draws):
                y = mx.argmax(logits, axis=-1)
            else:
                y = mx.concatenate([mx.argmax(logits[i:i + 1], axis=-1) if d is None
                                    else d(logits[i:i + 1], j) for i, d in enumerate(draws)])
            device_async_eval(y)
            return y

        y = draw_all(self._forward(mx.array([c[len(c) - width:] for c in contexts]),
                                   self._cache)[:, -1], 0)
        drafted = [y]
        for j in range(1, k):
            y = draw_all(self._forward(y[:, None], self._cache)[:, -1], j)
            drafted.append(y)
        out = cast(list[list[int]], mx.stack(drafted, axis=1).tolist())
        for toks, d in zip(self._tokens, out, strict=True):
            toks += d[:-1]  # the last draft was never fed
        return out
