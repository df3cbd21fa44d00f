"""A step's tokens (engine/batch/step_tokens.py): what goes out, what each row's token calls for,
on mlx-lm's own response records."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import GenerationBatch

from mlxd.engine.batch.rows import Row, RowTable
from mlxd.engine.batch.step_tokens import StepRead, early, first_tokens, read_responses

EOS = frozenset({2})


def response(uid: int, token: int, finish: str | None = None) -> GenerationBatch.Response:
    ended = finish is not None
    return GenerationBatch.Response(uid, token, mx.array(0.0), finish,
                                    ["cache"] if ended else None, [token] if ended else None)


def table(*rows: Row) -> RowTable:
    t = RowTable()
    for r in rows:
        t.add(r)
    return t


def row(uid: int, **kw) -> Row:
    return Row(uid, f"r{uid}", prompt_len=10, received_at=1.0, admitted_at=1.5,
               max_tokens=kw.pop("max_tokens", 100), **kw)


def test_early_first_tokens_go_out_once_and_their_late_copies_are_dropped():
    a, b, c, d = row(1), row(2, logprobs=2), row(3, max_tokens=1), row(4)
    rows = table(a, b, c, d)
    assert early(a) and not early(b) and not early(c)  # log-probabilities; a one-token budget
    read = StepRead()
    first_tokens([a, b, c, d], {1: 7, 2: 8, 3: 9, 4: 2}, EOS, read)
    # d's first token is an end-of-sequence token: it comes from mlx-lm's next(), with its finish
    assert read.tokens == [("r1", 7, None)] and read.first == [a]
    assert a.sent_first == 7 and a.generated == 1 and not a.first_pending
    assert d.first_pending and d.sent_first == -1
    # a step later mlx-lm returns a's token again (dropped) and the others' first tokens
    read = StepRead()
    read_responses([response(1, 7), response(2, 8), response(3, 9, "length"),
                    response(4, 2, "stop")], rows, 0, read)
    assert read.tokens == [("r2", 8, None), ("r3", 9, "length"), ("r4", 2, "stop")]
    assert read.first == [b, c, d] and a.sent_first == -1 and a.generated == 1
    assert [r.request_id for r, _ in read.ended] == ["r3", "r4"]
    assert read.ended[0][1].prompt_cache == ["cache"]
    assert rows.get(3) is None and rows.get(4) is None and rows.get(1) is a  # ended rows leave
    assert [(rid, n) for rid, _, n in read.wanted] == [("r2", 2)]
    read = StepRead()
    read_responses([response(1, 5), response(2, 6)], rows, 0, read)
    assert read.tokens == [("r1", 5, None), ("r2", 6, None)] and read.first == []
    assert a.generated == 2 and b.generated == 2


def test_checkpoints_fall_due_every_n_generated_tokens_whichever_path_sent_them():
    """Row 1's first token goes early, row 2's comes from mlx-lm: each falls due at its 2nd and
    4th token, row 1's counted where mlx-lm returns it (its early token's copy included)."""
    early_row, plain = row(1), row(2)
    rows = table(early_row, plain)
    read = StepRead()
    first_tokens([early_row], {1: 7}, EOS, read)  # row 1's token 1
    read_responses([response(2, 5)], rows, 2, read)  # row 2's token 1
    sent, due = [read.tokens], [read.due]
    for _ in range(4):
        read = StepRead()
        read_responses([response(1, 5), response(2, 5)], rows, 2, read)
        sent.append(read.tokens)
        due.append(read.due)
    assert [len(t) for t in sent] == [2, 1, 2, 2, 2]  # row 1's copy of token 1 is not sent
    assert due == [[], [2], [1], [2], [1]]
    assert (early_row.generated, plain.generated) == (4, 5)  # the tokens each row sent


def test_a_budgets_closing_that_ends_in_the_last_token_finishes_with_stop():
    class Closed:
        def completed_by(self, position: int, token: int) -> bool:
            return token == 125  # "}"
    done, cut = row(1, grammar=Closed()), row(2, grammar=Closed())
    rows = table(done, cut)
    read = StepRead()
    read_responses([response(1, 125, "length"), response(2, 44, "length"),
                    response(9, 1)], rows, 0, read)  # uid 9: a row the runner no longer holds
    assert read.tokens == [("r1", 125, "stop"), ("r2", 44, "length")]
    assert len(rows) == 0
