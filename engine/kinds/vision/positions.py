"""3-D rotary positions (Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's M-RoPE) for the rows of a
batch, derived from each row's tokens alone, so that they survive every cache. (Qwen3-VL
interleaves the three components' frequencies inside its rotary embedding; the positions
themselves follow the same rule, mlx-vlm's `get_rope_index` for each.)

In those models a text token's three position components are equal and an image's token at
(frame t, row h, column w) of its merged-patch grid takes (s + t, s + h, s + w), where s is the
position the next text token would have had; the text after an image resumes at
s + max(frames, rows, columns). A position is therefore a function of the tokens before it
and of each image's grid, and mlxd's image tokens name their image (its hash-derived ids, see
`model.py`), whose grid the `ImageTable` keeps. A row restored from a cached prefix (RAM or
SSD) or resumed after a crash carries its whole token list (mlx-lm keeps it, cached tokens
first), so its positions, and the offset ("rope delta") its decode steps need, are recomputed
from it: nothing about positions is stored with a cache entry, and nothing can go stale.

`RowPositions` is told each row's token list before a batch's forward passes (through
`mlx_lm_internals.hook_row_tokens`) and scans each list once, incrementally: a decode step
costs one token's scan per row."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

# token id -> (its index in its image, the image's merged grid (frames, rows, columns)), or
# None for a text token
Locate = Callable[[int], tuple[int, tuple[int, int, int]] | None]

PRUNE_EVERY = 256  # passes between drops of rows not seen since the last drop


@dataclass
class _Row:
    tokens: list[int]  # mlx-lm's list for the row (held, so its id is not reused)
    positions: list[np.ndarray] = field(default_factory=list)  # (3, n) pieces, scanned ones
    scanned: int = 0
    delta: int = 0  # position - index, for the next text token
    start: int = 0  # the open image's start position (s)
    seen: int = 0


class RowPositions:
    def __init__(self, locate: Locate) -> None:
        self._locate = locate
        self._rows: dict[int, _Row] = {}
        self._current: list[_Row] | None = None
        self._starts: list[int] = []
        self._fed = 0  # columns fed since the rows were set (prompt chunks of one call)
        self._passes = 0

    def set_row_tokens(self, tokens: list[list[int]], starts: list[int]) -> None:
        self._passes += 1
        rows = []
        for t in tokens:
            row = self._rows.get(id(t))
            if row is None or row.tokens is not t:
                row = self._rows[id(t)] = _Row(t)
            row.seen = self._passes
            rows.append(row)
        self._current, self._starts, self._fed = rows, list(starts), 0
        if self._passes % PRUNE_EVERY == 0:
            old = self._passes - PRUNE_EVERY
            self._rows = {k: r for k, r in self._rows.items() if r.seen > old}

    def clear(self) -> None:
        self._current = None

    def __call__(self, batch: int, length: int) -> np.ndarray | None:
        """The (3, batch, length) positions of the next `length` columns fed for the rows
        set, or None where no rows are set (a pass outside the generator: no images)."""
        rows = self._current
        if rows is None or len(rows) != batch:
            return None
        out = np.empty((3, batch, length), dtype=np.int32)
        for b, (row, start) in enumerate(zip(rows, self._starts, strict=True)):
            out[:, b, :] = self._row(row, start + self._fed, length)
        self._fed += length
        return out

    def _row(self, row: _Row, begin: int, length: int) -> np.ndarray:
        end = begin + length
        self._scan(row, min(end, len(row.tokens)))
        known = np.concatenate(row.positions, axis=1) if len(row.positions) > 1 \
            else (row.positions[0] if row.positions else np.empty((3, 0), np.int32))
        row.positions = [known] if known.shape[1] else []
        got = known[:, max(begin, 0):min(end, known.shape[1])]
        if begin < 0 or end > known.shape[1]:  # padding, or past the list (a decode step)
            tail = np.arange(max(begin, known.shape[1]), end, dtype=np.int32) + row.delta
            head = np.arange(begin, min(0, end), dtype=np.int32)
            got = np.concatenate([np.broadcast_to(head, (3, head.size)), got,
                                  np.broadcast_to(tail, (3, tail.size))], axis=1)
        return got

    def _scan(self, row: _Row, upto: int) -> None:
        if upto <= row.scanned:
            return
        tokens = row.tokens
        piece = np.empty((3, upto - row.scanned), dtype=np.int32)
        for k in range(row.scanned, upto):
            where = self._locate(tokens[k])
            if where is None:
                piece[:, k - row.scanned] = k + row.delta
                continue
            i, (frames, rows, cols) = where
            if i == 0:
                row.start = k + row.delta
            area = rows * cols
            piece[:, k - row.scanned] = (row.start + i // area, row.start + (i // cols) % rows,
                                         row.start + i % cols)
            n = frames * area
            if i == n - 1:  # the image's last position: the text resumes past its grid
                row.delta = row.start + max(frames, rows, cols) - (k + 1)
        row.positions.append(piece)
        row.scanned = upto
