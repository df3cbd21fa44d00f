"""A prompt's last token fed in its final chunk's forward pass (the hidden setting
`fold_last_token`, on by default). Runs on the MLX thread, inside mlx-lm's generator.

mlx-lm's `BatchGenerator` feeds a prompt in chunks of all but its last token, then feeds the
last token in a forward pass of its own as the row starts decoding (`GenerationBatch`'s
construction samples the first token from it). A first token thus waits for two passes after
a cached prefix, and on a GPU a one-token pass of a ~1B model is several milliseconds of graph
building and kernel launches: much of a cached next turn's time to first token
(benchmarks/RESULTS.md, "Vision cache"). Folded, the final chunk carries the last token, the
model's logits at each folded row's last position are kept (evaluated with the chunk's cache),
and the row starts decoding with its first token sampled from them exactly as the separate
pass would have left it: the same samplers, the same state of every batch list.

Only where that is safe and cheap (`fold_rows`, pure):
- a row whose final chunk, the last token added, still fits the step (one pass, as before);
- a row the runner allows (`row_may_fold`): not one of a model with state layers (sliding
  windows, recurrent states) whose snapshot one token short of the prompt's end is due
  (`kv/snapshot_points.py`): that state is usable only at its exact position, and it is what
  a re-sent prompt restores (all but the token always fed) and where a next turn whose client
  rendered the answer anew continues;
- not a row with logits processors (grammars, penalties: their first call keeps mlx-lm's
  path);
- while the chunk's logits, which the model computes for every position of every row, stay
  small (`MAX_LOGITS` elements): a short next turn is folded, a burst of long prompts (whose
  extra one-token pass costs little beside them) is not.
A generator of another shape (a sharded group's leader, whose followers replay its calls) is
never folded.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch
from mlx_lm.models.cache import TokenBuffer

MAX_LOGITS = 1 << 24  # elements: rows x longest chunk x vocabulary (64 MB of float32)

_gen: BatchGenerator | None = None
_may_fold: Callable[[int], bool] = lambda uid: False  # noqa: E731
_vocab = 0  # the largest vocabulary a pass has shown (or the configuration's, until one)
# Filled by a folded pass, emptied by `start_folded` in the same step: uid -> (last token,
# its logits row, lazy until the chunk's evaluation)
_folded: dict[int, tuple[int, mx.array]] = {}
# Arrays the next evaluation of mlx-lm's generator takes along (`mlx_lm_internals` shim)
eval_with: list[mx.array] = []


def fold_rows(chunks: Sequence[int], left: Sequence[Sequence[Sequence[int]]],
              allowed: Sequence[bool], step: int, vocab: int) -> list[int]:
    """Which rows of a prompt batch's pass get their last token folded in: `chunks[i]` is
    row i's chunk length in this pass, `left[i]` its segments still to feed after it, `allowed`
    the runner's say. Pure."""
    rows = [i for i, (n, rest, ok) in enumerate(zip(chunks, left, allowed, strict=True))
            if ok and len(rest) == 1 and len(rest[0]) == 1 and n + 1 <= step]
    if not rows:
        return []
    longest = max(max(chunks), max(chunks[i] + 1 for i in rows))
    return rows if len(chunks) * longest * max(vocab, 1) <= MAX_LOGITS else []


def row_may_fold(prompt_len: int, snap_at: Container[int]) -> bool:
    """Whether a row's last token may be folded in: its prompt of `prompt_len` tokens and
    its snapshot points `snap_at`. Pure."""
    return prompt_len - 1 not in snap_at


@contextmanager
def folding(gen: Any, may_fold: Callable[[int], bool]) -> Iterator[None]:
    """Around one `next()` of `gen` (and its speculation's): its prompt pass may fold rows
    that `may_fold(uid)` allows. The runner calls `start_folded` after it."""
    global _gen, _may_fold, _vocab
    if type(gen) is not BatchGenerator:
        yield
        return
    if not _vocab:
        _vocab = vocab_size(gen.model)
    _gen, _may_fold = gen, may_fold
    try:
        yield
    finally:
        _gen, _may_fold = None, lambda uid: False


def vocab_size(model: Any) -> int:
    """The model's vocabulary as its configuration states it, until a pass shows it;
    unknown, a large one (the bound on logits then folds less, never more)."""
    for args in (getattr(model, "args", None), getattr(model, "config", None)):
        n = getattr(args, "vocab_size", None) or getattr(
            getattr(args, "text_config", None), "vocab_size", None)
        if isinstance(n, int) and n > 0:
            return n
    return 1 << 18


def folding_prompt(prompt: Callable[[Any, list[list[int]]], Any]
                   ) -> Callable[[Any, list[list[int]]], Any]:
    """mlx-lm's `PromptProcessingBatch.prompt`, folding where `folding` allows."""

    def fold_or_prompt(self: Any, tokens: list[list[int]]) -> Any:
        gen = _gen
        if gen is None or self is not gen._prompt_batch or not tokens:
            return prompt(self, tokens)
        processing = gen._currently_processing
        rows = fold_rows([len(t) for t in tokens], [seq[0] for seq in processing],
                         [_may_fold(uid) and not self.logits_processors[i]
                          for i, uid in enumerate(self.uids)],
                         self.prefill_step_size, _vocab)
        if not rows:
            return prompt(self, tokens)
        lasts = []
        for i in rows:
            seq = processing[i]
            lasts.append(seq[0].pop()[0])  # its one segment left, [last]: none is left after
            tokens[i] = [*tokens[i], lasts[-1]]
            seq[1] += 1
        capture = _LastLogits(self.model, rows, [len(tokens[i]) - 1 for i in rows])
        self.model = capture
        try:
            out = prompt(self, tokens)
        finally:
            self.model = capture.model
            eval_with.clear()
        for i, last, row_logits in zip(rows, lasts, capture.rows(), strict=True):
            _folded[self.uids[i]] = (last, row_logits)
        return out

    return fold_or_prompt


class _LastLogits:
    """The model for one prompt pass: keeps the logits at the folded rows' last positions,
    evaluated with the pass's cache."""

    def __init__(self, model: Any, rows: list[int], positions: list[int]) -> None:
        self.model, self._rows, self._positions = model, rows, positions
        self._logits: mx.array | None = None

    def __call__(self, inputs: mx.array, *args: Any, **kwargs: Any) -> Any:
        if self._logits is not None:
            raise RuntimeError("a folded prompt chunk ran as more than one pass")
        global _vocab
        out = self.model(inputs, *args, **kwargs)
        _vocab = int(out.shape[-1])
        self._logits = out[mx.array(self._rows), mx.array(self._positions)]
        eval_with.append(self._logits)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def rows(self) -> list[mx.array]:
        assert self._logits is not None
        return [self._logits[k:k + 1] for k in range(len(self._rows))]


def start_folded(gen: Any) -> list[Any]:
    """Move the rows whose last token was folded into this step's pass to generation, their
    first token sampled from that pass's logits as `GenerationBatch`'s own first step would
    have sampled it. Returns their prompt responses (ends of prompts)."""
    if not _folded:
        return []
    folded = dict(_folded)
    _folded.clear()
    processing = gen._currently_processing
    uids = gen._prompt_batch.uids
    split = [i for i, seq in enumerate(processing) if not seq[0] and uids[i] in folded]
    progress = [(processing[i][2],) * 2 for i in split]
    with mx.stream(gen._stream):
        moved = set(split)
        gen._currently_processing = [seq for i, seq in enumerate(processing) if i not in moved]
        part = gen._prompt_batch.split(split)
        batch = _started(part, [folded[u] for u in part.uids])
        gen._generation_batch.extend(batch)
    return [PromptProcessingBatch.Response(uid, p, True, True)
            for uid, p in zip(batch.uids, progress, strict=True)]


def _started(part: Any, folded: list[tuple[int, mx.array]]) -> Any:
    """A `GenerationBatch` of `part`'s rows as its construction leaves one (its first step
    run: the last tokens fed, the first tokens sampled and dispatched), from the folded
    logits. Mirrors mlx-lm's `GenerationBatch.__init__` and `_step`."""
    n = len(part.uids)
    gb: Any = GenerationBatch.__new__(GenerationBatch)  # (its fields set here, as __init__ would)
    gb.model, gb.uids = part.model, part.uids
    gb.prompt_cache, gb.tokens = part.prompt_cache, part.tokens  # (the last tokens included)
    gb.samplers, gb.fallback_sampler = part.samplers, part.fallback_sampler
    gb.logits_processors, gb.stop_sequences = part.logits_processors, part.stop_sequences
    gb.max_tokens = part.max_tokens
    gb._token_context = [TokenBuffer(t) for t in part.tokens]
    gb._num_tokens = [0] * n
    gb._matchers = [ss.matcher() for ss in part.stop_sequences]
    gb._current_tokens = mx.array([last for last, _ in folded])
    gb._current_logprobs = []
    logits = mx.concatenate([row for _, row in folded], axis=0)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    samplers = [part.fallback_sampler if s is None else s
                for s in (part.samplers or [None] * n)]
    if not samplers or all(s is samplers[0] for s in samplers):
        sampled = (samplers[0] if samplers else part.fallback_sampler)(logprobs)
    else:
        sampled = mx.concatenate([s(logprobs[e:e + 1]) for e, s in enumerate(samplers)],
                                 axis=0)
    gb._next_tokens = sampled
    gb._next_logprobs = list(logprobs)
    mx.async_eval(gb._next_tokens, gb._next_logprobs)
    return gb
