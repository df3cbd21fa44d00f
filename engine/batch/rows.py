"""What the runner knows of each row it holds, in one record per row (`Row`, in a `RowTable`
by uid and by request id), and the prefill groups of requests that answer one prompt
(`PrefillGroup`). Plain data, owned by the MLX thread."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from mlxd.engine.batch.messages import AddRequest

GROUP_TTL = 30.0  # seconds a prefill group waits for members that may never come


@dataclass
class Row:
    """One request running in the generator (from insert to its end)."""
    uid: int  # the generator's
    request_id: str
    prompt_len: int  # its prompt's tokens (the prompt boundary published at its end)
    received_at: float  # monotonic: when the engine received it (0: unknown)
    admitted_at: float  # when it was inserted
    logprobs: int = -1  # top alternatives to report per token (-1: none)
    started_from: int = 0  # prompt tokens it took from a tier or a leader (not prefilled)
    generated: int = 0  # tokens generated, for generation checkpoints
    first_pending: bool = True  # its first token is still to come
    max_tokens: int = 0  # the most tokens it may generate
    # its first token, sent in the step that computed it: mlx-lm's `next()` returns the same
    # token a step later, which is not sent again (`Runner._send_first_tokens`); -1: none
    sent_first: int = -1
    prefilling: list[int] | None = None  # its prompt, while others may wait to share it
    followers: list[AddRequest] = field(default_factory=list)  # requests waiting for it
    leads: str = ""  # the prefill group whose prompt it prefills
    # (models with state layers) prompt positions to snapshot on the way, and those taken
    snap_at: frozenset[int] = frozenset()
    snaps: dict[int, list[Any]] = field(default_factory=dict)
    waits: dict[str, int] = field(default_factory=dict)  # follower request id -> its point
    # its output grammar when a budget guards it: a document closed in the last token is
    # complete (finish: stop, not length)
    grammar: Any = None
    speculate: bool = True  # False: never in a speculative step (`AddRequest.speculate`)


class RowTable:
    def __init__(self) -> None:
        self._by_uid: dict[int, Row] = {}
        self._by_rid: dict[str, Row] = {}
        # rows that never speculate: they ask for log-probabilities (a verify pass reports
        # none), or their prompt holds images
        self.plain_uids: set[int] = set()

    def __len__(self) -> int:
        return len(self._by_uid)

    def __iter__(self) -> Iterator[Row]:
        return iter(list(self._by_uid.values()))

    def add(self, row: Row) -> None:
        self._by_uid[row.uid] = row
        self._by_rid[row.request_id] = row
        if row.logprobs >= 0 or not row.speculate:
            self.plain_uids.add(row.uid)

    def get(self, uid: int) -> Row | None:
        return self._by_uid.get(uid)

    def by_request(self, request_id: str) -> Row | None:
        return self._by_rid.get(request_id)

    def pop(self, uid: int) -> Row | None:
        row = self._by_uid.pop(uid, None)
        if row is not None:
            del self._by_rid[row.request_id]
            self.plain_uids.discard(uid)
        return row

    def request_ids(self) -> list[str]:
        return list(self._by_rid)

    def uids(self) -> list[int]:
        return list(self._by_uid)

    def clear(self) -> None:
        self._by_uid.clear()
        self._by_rid.clear()
        self.plain_uids.clear()


@dataclass
class PrefillGroup:
    """The rows answering one prompt (OpenAI `n`): the first to arrive prefills it, the others
    wait for its prompt and start from a view of its KV (only the last prompt token is theirs
    to feed). Kept until every member has arrived, or GROUP_TTL passed."""
    leader: int | None  # its uid while its prompt is being prefilled
    waiting: list[AddRequest]
    expected: int  # members still to arrive
    created: float
    prefix: tuple[Any, list[int]] | None = None  # (codec.Held, tokens) once prefilled
