"""A step's tokens: which of them go out, and what each row's token calls for. Pure (the rows'
records and mlx-lm's responses as plain data; the runner does the MLX and the sending).

mlx-lm's `BatchGenerator.next()` returns one response per decoding row: its token, and a
finish reason with the row's cache where the token ends it. The runner adds tokens of its own:
a row's first token read in the step that computed it (`early_first`, `Runner._send_first_tokens`),
whose copy mlx-lm returns a step later and which is then dropped here. What is left to the
runner: counting first tokens, ending the finished rows (releasing their room and followers,
publishing their histories), the checkpoints due and the log-probabilities asked for.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from mlxd.engine.batch.rows import Row, RowTable
from mlxd.protocol.messages import FinishReason


@dataclass
class StepRead:
    # what to send: (request id, token, finish reason), in the step's order
    tokens: list[tuple[str, int, FinishReason | None]] = field(default_factory=list)
    first: list[Row] = field(default_factory=list)  # rows whose first token this step sends
    wanted: list[tuple[str, Any, int]] = field(default_factory=list)  # log-probabilities asked
    due: list[int] = field(default_factory=list)  # uids whose generation checkpoint is due
    ended: list[tuple[Row, Any]] = field(default_factory=list)  # finished rows, last response


def first_tokens(ended: Iterable[Row], sampled: dict[int, int], eos: frozenset[int],
                 read: StepRead) -> None:
    """Rows whose prompt ended in this step, with the first tokens `sampled` read back for
    them: a token that cannot end its row goes out now (the row may generate more, and it is
    no end-of-sequence token); none for a row asking for log-probabilities (the copy mlx-lm
    returns a step later carries its alternatives and finish reason)."""
    for row in ended:
        if not early(row):
            continue
        token = sampled.get(row.uid)
        if token is None or token in eos:
            continue
        row.sent_first = token
        row.generated += 1
        row.first_pending = False
        read.first.append(row)
        read.tokens.append((row.request_id, token, None))


def early(row: Row) -> bool:
    """Whether a row whose prompt just ended may have its first token sent early."""
    return row.first_pending and row.logprobs < 0 and row.max_tokens > 1


def read_responses(responses: Iterable[Any], rows: RowTable, checkpoint_every: int,
                   read: StepRead) -> None:
    """mlx-lm's responses of a step, into `read`. A finished row leaves `rows` (its room and
    followers are the runner's to release)."""
    for r in responses:
        row = rows.get(r.uid)
        if row is None:
            continue
        if row.sent_first >= 0 and r.finish_reason is None:
            row.sent_first = -1  # the first token, sent a step ago
            if checkpoint_every and row.generated % checkpoint_every == 0:
                read.due.append(r.uid)
            continue
        if row.first_pending:
            row.first_pending = False
            read.first.append(row)
        finish = r.finish_reason
        if finish == "length" and row.grammar is not None \
                and row.grammar.completed_by(row.generated, r.token):
            finish = "stop"  # the budget's closing ended in the last token: complete
        read.tokens.append((row.request_id, r.token, finish))
        if row.logprobs >= 0:
            read.wanted.append((row.request_id, r, row.logprobs))
        if r.finish_reason is None:
            row.generated += 1
            if checkpoint_every and row.generated % checkpoint_every == 0:
                read.due.append(r.uid)
            continue
        rows.pop(r.uid)
        read.ended.append((row, r))
