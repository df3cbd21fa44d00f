"""A prompt's last token fed in its final chunk's forward pass (the hidden setting
`fold_last_token`, on by default): the policy, pure. The fold itself, which reads and
patches mlx-lm's batch internals, is `mlx_lm_internals.py`'s (`folding`, `start_folded`).

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
- a row whose final chunk, the last token added, still fits the step (one pass, as before)
  and is short (`chunk_limit`): the logits the fold keeps need the last layer's attention and
  MLP over the whole chunk (the cache alone stops before them), which a long chunk pays more
  for than a one-token pass costs. On the CPU, where time follows the tokens computed, a chunk
  of up to as many tokens as the model has layers costs at most one token's whole pass more;
  on a GPU, where a short pass costs its launches and graph building more than its tokens, up
  to GPU_CHUNK tokens (a chat's next turn: benchmarks/RESULTS.md, "A next turn one pass and
  one copy shorter");
- a row the runner allows (`row_may_fold`): not one of a model with state layers (sliding
  windows, recurrent states) whose snapshot one token short of the prompt's end is due
  (`kv/snapshot_points.py`): that state is usable only at its exact position, and it is what
  a re-sent prompt restores (all but the token always fed) and where a next turn whose client
  rendered the answer anew continues;
- not a row with logits processors (grammars, penalties: their first call keeps mlx-lm's
  path);
- the logits of the folded rows' last positions alone, where the model's output head (its
  `lm_head`, or the embedding tied to it) can be applied to those positions only (a probe
  as the fold is enabled checks it against the whole output); otherwise the model computes every
  position's logits, and then only while they stay small (`MAX_LOGITS` elements: a short
  next turn is folded, a burst of long prompts keeps its one-token pass).
A generator of another shape (a sharded group's leader, whose followers replay its calls) is
never folded.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Any

MAX_LOGITS = 1 << 24  # elements: rows x longest chunk x vocabulary (64 MB of float32)
GPU_CHUNK = 64  # tokens: the longest final chunk a GPU folds (measured: 23-36)


def chunk_limit(gpu: bool, layers: int) -> int:
    """The longest final chunk (its last token included) that folds: see the module's
    docstring."""
    return GPU_CHUNK if gpu else max(1, layers)


def fold_rows(chunks: Sequence[int], left: Sequence[Sequence[Sequence[int]]],
              allowed: Sequence[bool], step: int, vocab: int,
              limit: int = GPU_CHUNK) -> list[int]:
    """Which rows of a prompt batch's pass get their last token folded in: `chunks[i]` is
    row i's chunk length in this pass, `left[i]` its segments still to feed after it, `allowed`
    the runner's say (and no logits processors), `vocab` what each position's logits cost (0:
    only the folded positions' are computed, and the bound does not apply), `limit` the
    longest final chunk that folds (`chunk_limit`)."""
    most = min(step, limit)
    rows = [i for i, (n, rest, ok) in enumerate(zip(chunks, left, allowed, strict=True))
            if ok and len(rest) == 1 and len(rest[0]) == 1 and n + 1 <= most]
    if not rows:
        return []
    longest = max(max(chunks), max(chunks[i] + 1 for i in rows))
    return rows if len(chunks) * longest * vocab <= MAX_LOGITS else []


def row_may_fold(prompt_len: int, snap_at: Container[int]) -> bool:
    """Whether a row's last token may be folded in: its prompt of `prompt_len` tokens and
    its snapshot points `snap_at`."""
    return prompt_len - 1 not in snap_at


def vocab_size(model: Any) -> int:
    """The model's vocabulary as its configuration states it, until a pass shows it;
    unknown, a large one (the bound on logits then folds less, never more)."""
    for args in (getattr(model, "args", None), getattr(model, "config", None)):
        n = getattr(args, "vocab_size", None) or getattr(
            getattr(args, "text_config", None), "vocab_size", None)
        if isinstance(n, int) and n > 0:
            return n
    return 1 << 18
