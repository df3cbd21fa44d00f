"""Constrained decoding with llguidance: a per-request logits processor that masks every token
the request's grammar does not allow next. Constrained and free requests share decode steps:
the processor runs only on its own row of the batch.

The mask for step k depends on the token sampled at step k-1, which mlx-lm's step has not read
back yet when it calls the processors of step k. So the mask work is ordered to keep the device
busy (`steps.py`): the step's forward pass is built first, then the previous tokens of every
constrained row are read in one synchronisation, all rows' masks are computed together on
llguidance's worker threads (GIL released) while this thread dispatches that forward pass and
the device runs it, and the masks become one boolean array for all rows (unpacked on a GPU from
the packed bits).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, cast

import mlx.core as mx
import numpy as np

from mlxd.engine.grammar.budget import (
    BudgetGuard,
    Decision,
    apply,
    closing_vocab,
    is_json_schema,
    start_memo,
)

_NEG_INF = float("-inf")
log = logging.getLogger("mlxd.engine")


class ConstraintError(ValueError):
    pass


class TokenizerCache:
    """llguidance's view of the engine's tokenizer, built once (it walks the vocabulary)."""

    def __init__(self, hf_tokenizer: Any, n_vocab: int, eos_ids: list[int]) -> None:
        self._hf, self._n_vocab, self._eos = hf_tokenizer, n_vocab, eos_ids
        self._lock = threading.Lock()
        self._ll: Any = None

    @property
    def n_vocab(self) -> int:
        return self._n_vocab

    def get(self) -> Any:
        with self._lock:
            if self._ll is None:
                import llguidance.hf
                try:
                    self._ll = llguidance.hf.from_tokenizer(self._hf, n_vocab=self._n_vocab,
                                                            eos_token=self._eos or None)
                except TypeError:  # older llguidance (1.6) takes one EOS token id, not a list
                    self._ll = llguidance.hf.from_tokenizer(
                        self._hf, n_vocab=self._n_vocab,
                        eos_token=self._eos[0] if self._eos else None)
            return self._ll


class OutOfOrder(RuntimeError):
    """A token offered for a position after one not consumed yet (a bug, never a user error)."""


class TokenFeed:
    """A matcher and how many generated tokens it has consumed: each generated position is
    consumed exactly once and in order, whichever path (batched or per-row) offers it."""

    def __init__(self, matcher: Any, history: list[int] | None = None) -> None:
        self.matcher = matcher
        self.consumed = 0  # generated tokens consumed so far (replayed ones not counted)
        self.history = history  # every consumed token appended, where a budget reads them

    def due(self, position: int) -> bool:
        """Whether the token at generated `position` is the next to consume (False: it was
        consumed already)."""
        if position > self.consumed:
            raise OutOfOrder(f"token {position} offered before token {self.consumed}")
        return position == self.consumed

    def consume(self, position: int, token: int) -> None:
        if self.due(position):
            self.matcher.consume_token(token)
            self.consumed += 1
            if self.history is not None:
                self.history.append(token)


_SHIFTS: list[mx.array] = []  # 0..7 as uint8, built once


def unpack_bits(bits: np.ndarray, vocab: int, on_device: bool | None = None) -> mx.array:
    """(rows, ceil(vocab/32)) int32 bitmasks -> a (rows, vocab) bool array. On the CPU backend
    numpy unpacks them (cheapest there: MLX's CPU gathers and broadcasts cost more); on a GPU
    the packed bits travel (a thirty-second of the mask's bytes) and are unpacked there."""
    if on_device is None:
        on_device = mx.default_device() != mx.cpu
    if not on_device:
        unpacked = np.unpackbits(bits.view(np.uint8), axis=-1, bitorder="little")
        return mx.array(unpacked[:, :vocab].view(np.bool_))
    if not _SHIFTS:
        shifts = mx.arange(8, dtype=mx.uint8)
        mx.eval(shifts)  # evaluated once: engines on other threads may share it
        _SHIFTS.append(shifts)
    packed = mx.array(bits).view(mx.uint8)
    unpacked_mx = (packed[:, :, None] >> _SHIFTS[0]) & 1
    return unpacked_mx.astype(mx.bool_).reshape(packed.shape[0], -1)[:, :vocab]


def apply_mask(logits: mx.array, allowed: mx.array) -> mx.array:
    return mx.where(allowed, logits, _NEG_INF)


class GrammarProcessor:
    """A BatchGenerator logits processor. `context` is the row's token history; from the
    second call on, its last token is the one sampled at the previous step.

    When the runner's step hook (`steps.GrammarSteps`) found this row in the
    batch, `plan` is set for the step and the mask comes from it (all rows at once); otherwise
    the row reads its token and computes its mask itself."""

    def __init__(self, tokenizers: TokenizerCache, grammar: str,
                 replay: list[int] | None = None, max_tokens: int | None = None) -> None:
        """`max_tokens`: the row's budget (generated tokens, after `replay`); given, a JSON
        schema's document is closed validly within it (`budget.py`). A budget that cannot hold
        even the shortest document gets no guard: the row is cut by max_tokens as before."""
        import llguidance
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
        self._allocate, self._fill = allocate_token_bitmask, fill_next_token_bitmask
        ll = tokenizers.get()
        if replay:
            self.matcher = llguidance.LLMatcher(ll, grammar)
        else:  # a copy of the grammar's start, built once for a burst (`StartMemo`)
            self.matcher = start_memo.get(ll, grammar, "matcher",
                                          lambda: llguidance.LLMatcher(ll, grammar)).deep_copy()
        if self.matcher.is_error():
            raise ConstraintError(self.matcher.get_error())
        for t in replay or []:  # a resumed request: what was delivered before the crash
            self.matcher.consume_token(t)
        self.budget: BudgetGuard | None = None
        self.shortest: int | None = None  # the shortest closing's tokens, from the start
        history: list[int] | None = None
        if max_tokens is not None and is_json_schema(grammar) and not self.matcher.is_error():
            history = list(replay or [])
            vocab = closing_vocab(tokenizers.get(), tokenizers.n_vocab)
            guard = BudgetGuard(vocab, self.matcher, max_tokens, history, grammar)
            self.shortest = guard.shortest
            if guard.fits:
                self.budget = guard
            else:
                history = None
        self.feed = TokenFeed(self.matcher, history)
        self._calls = 0
        self._warned = False
        self.plan: Any = None  # set by the step hook for the step in progress
        # The first mask needs no sampled token: computed here, on the admission lane.
        self._vocab = tokenizers.n_vocab
        self._first: np.ndarray | None = None
        if not self.matcher.is_error():
            self._first = self.row_bits(self._vocab)

    def decision(self) -> Decision | None:
        """The budget's word on the next token (None: no budget, the grammar alone)."""
        return None if self.budget is None else self.budget.decide(self.feed.consumed)

    @property
    def closed_for_budget(self) -> bool:
        """The budget steered the document to its end (it is complete and valid all the same:
        the finish is the normal one)."""
        return self.budget is not None and self.budget.closed_for_budget

    def completed_by(self, position: int, token: int) -> bool:
        """Whether `token`, the row's last (generated `position`, max_tokens reached), leaves
        the document complete and valid: a budget's closing that ends exactly at the last
        token. The matcher may have consumed it already (mlx-lm computes the step after it
        before it reports the finish); else a copy of the matcher is offered it."""
        if self.matcher.is_error():
            return False
        if self.feed.consumed > position:
            return bool(self.matcher.is_accepting())
        m = self.matcher.deep_copy()
        return bool(m.try_consume_tokens([token]) == 1 and m.is_accepting())

    def row_bits(self, vocab: int) -> np.ndarray:
        """This row's packed mask for the next token: the grammar's, and the budget's word."""
        bits = self._allocate(1, vocab)
        d = self.decision()
        if d is None or d.force is None:
            self._fill(self.matcher, bits, 0)
        if d is not None and self.budget is not None:
            apply(d, bits, 0, self.budget.vocab)
        return bits

    @property
    def calls(self) -> int:
        return self._calls

    def skip_call(self) -> None:
        """The step masked this row with the whole batch (`steps.WholeBatchMask`)
        instead of calling it."""
        self._calls += 1
        self.plan = None

    def check_error(self) -> bool:
        """True (and one warning) once the grammar failed: the rest is unconstrained."""
        if not self.matcher.is_error():
            return False
        if not self._warned:  # should not happen: every sampled token was allowed
            log.warning("output grammar failed (%s); the rest is unconstrained",
                        self.matcher.get_error())
            self._warned = True
        return True

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        calls, self._calls = self._calls, self._calls + 1
        plan, self.plan = self.plan, None
        if plan is not None:
            allowed = plan.allowed(self, logits)
        else:
            allowed = self._own_mask(calls, context, logits)
        return logits if allowed is None else apply_mask(logits, allowed)

    def _own_mask(self, calls: int, context: mx.array, logits: mx.array) -> mx.array | None:
        """This row alone: start the forward pass, then wait for the previous token."""
        vocab = logits.shape[-1]
        if calls == 0 and self._first is not None and vocab == self._vocab:
            bits = self._first
        else:
            if calls:
                mx.async_eval(logits)  # the device runs the forward pass meanwhile
                self.feed.consume(calls - 1, cast(int, context[-1].item()))  # token ids: int
            if self.check_error():
                return None
            bits = self.row_bits(vocab)
        return unpack_bits(bits, vocab)
