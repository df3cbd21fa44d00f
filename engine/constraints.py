"""Constrained decoding with llguidance: a per-request logits processor that masks every token
the request's grammar does not allow next. Constrained and free requests share decode steps:
the processor runs only on its own row of the batch.

The mask for step k depends on the token sampled at step k-1, so a constrained row waits for
that token (one GPU synchronisation per step for a batch holding a constrained row); free
batches keep mlx-lm's overlap of graph building and GPU work.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, cast

import mlx.core as mx
import numpy as np

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

    def get(self) -> Any:
        with self._lock:
            if self._ll is None:
                import llguidance.hf
                self._ll = llguidance.hf.from_tokenizer(self._hf, n_vocab=self._n_vocab,
                                                        eos_token=self._eos or None)
            return self._ll


class GrammarProcessor:
    """A BatchGenerator logits processor. `context` is the row's token history; from the
    second call on, its last token is the one sampled at the previous step."""

    def __init__(self, tokenizers: TokenizerCache, grammar: str,
                 replay: list[int] | None = None) -> None:
        import llguidance
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
        self._allocate, self._fill = allocate_token_bitmask, fill_next_token_bitmask
        self.matcher = llguidance.LLMatcher(tokenizers.get(), grammar)
        if self.matcher.is_error():
            raise ConstraintError(self.matcher.get_error())
        for t in replay or []:  # a resumed request: what was delivered before the crash
            self.matcher.consume_token(t)
        self._calls = 0
        self._warned = False
        self._bitmask: np.ndarray | None = None

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        if self._calls:
            self.matcher.consume_token(cast(int, context[-1].item()))  # token ids: an int
        self._calls += 1
        vocab = logits.shape[-1]
        if self._bitmask is None:
            self._bitmask = self._allocate(1, vocab)
        if self.matcher.is_error():  # should not happen: every sampled token was allowed
            if not self._warned:
                log.warning("output grammar failed (%s); the rest is unconstrained",
                            self.matcher.get_error())
                self._warned = True
            return logits
        self._fill(self.matcher, self._bitmask, 0)
        allowed = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[:vocab]
        return mx.where(mx.array(allowed.astype(np.bool_)), logits, _NEG_INF)
