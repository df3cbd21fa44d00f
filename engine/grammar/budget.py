"""Budget-aware JSON constraints: a row constrained to a JSON schema ends as a valid document
within its max_tokens, instead of being cut mid-string.

Each step a guarded row is in one of four modes, from its slack: the tokens it has left less
the tokens the shortest closing of its document takes from where it stands (`closing.py`,
tokenized):

- free (slack > CALM): the grammar's mask alone;
- calm (slack <= CALM): no token that opens something (`{`, `[`, `,`) but the closing's first,
  and no key of the row's choosing (a key is where the closing says): a new key, item or
  container is what makes the closing suddenly longer, so the row fills in the values it
  has open and follows the closing's structure;
- near (slack <= NEAR): the same while the row is inside a string value or a number (it may
  go on with what it is writing); anywhere else the closing's next token is forced (a
  separator, a key, the start of a value the row then fills in);
- closing (slack <= MARGIN): the closing's tokens are forced one by one; then the grammar
  allows nothing but the end of the sequence.

A row where the budget forced a token the grammar did not force anyway was closed for the
budget (`closed_for_budget`). Its document is complete and valid for the schema, so its finish
is the normal one (the end token, or the runner's check that the last token completed it): the
clients asked for a schema-valid object and got one. Only a row the budget could not close
(a budget under the shortest closing, or a closing that no longer fits) is cut: "length".

One token in free mode may open a lot (`":[{"`: an array of objects with required keys): CALM
is wide so that such a jump still leaves room. The closing is computed again only once the
row could be calm, were it to grow by GROWTH tokens a step since it was last computed (every
step at the end, rarely before): a scratch copy of the matcher walked a byte at a time, about
half a millisecond. A request whose budget cannot hold even the closing from the start gets
no guard (`BudgetGuard.fits` is False): it is served and cut by max_tokens as any row.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from mlxd.engine.grammar.closing import JsonLex, closing

log = logging.getLogger("mlxd.engine")

CALM = 64  # slack under which nothing new may be opened (at least; `BudgetGuard.calm`)
NEAR = 16  # slack under which the row only finishes the value it is writing
MARGIN = 3  # slack kept when the closing is forced (an enum's or a number's growth)
# How many tokens one generated token may add to the closing, at most (`[{"` may open an
# object with required keys, and more): the closing is computed again once the row may be
# near at that rate, not every step.
GROWTH = 16
_LIMIT_BYTES = 8192  # a closing longer than this is not searched for
_OPENERS = b"{[,"


def fully_required(schema: Any) -> Any:
    """`schema` with every listed property required and every array at least one item long
    (unless it may hold none): its shortest document bounds what one token can add to a
    closing, opening an optional key or a further item (`BudgetGuard.calm`)."""
    if isinstance(schema, list):
        return [fully_required(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: fully_required(v) for k, v in schema.items()}
    props = out.get("properties")
    if isinstance(props, dict):
        out["required"] = list(props)
    if out.get("type") == "array" and out.get("maxItems") != 0:
        out["minItems"] = max(1, out.get("minItems", 0) if isinstance(
            out.get("minItems"), int) else 1)
    return out


def schema_of(grammar: str) -> Any:
    return json.loads(grammar)["grammars"][0]["json_schema"]


def is_json_schema(grammar: str) -> bool:
    """Whether `grammar` is llguidance's JSON-schema grammar (what the proxy builds for
    response formats and forced tool calls), the only kind the closing knows how to end."""
    try:
        spec = json.loads(grammar)
        parts = spec["grammars"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(parts, list) and len(parts) == 1 and isinstance(parts[0], dict) \
        and parts[0].get("json_schema") is not None


class ClosingVocab:
    """What the closings of one tokenizer need, built once: the token of each printable byte
    (the greedy search's steps) and, as a packed bitmask, the tokens that open nothing."""

    def __init__(self, ll_tokenizer: Any, n_vocab: int) -> None:
        self.ll = ll_tokenizer
        self.n_vocab = n_vocab
        self.byte_token: dict[int, int] = {}
        for b in range(0x20, 0x100):
            if b == 0x7F:
                continue
            ids = ll_tokenizer.tokenize_bytes(bytes((b,)))
            if len(ids) == 1 and ll_tokenizer.decode_bytes(ids) == bytes((b,)):
                self.byte_token[b] = ids[0]
        words = (n_vocab + 31) // 32
        calm = np.zeros(words * 32, dtype=np.bool_)
        for t in range(min(n_vocab, ll_tokenizer.vocab_size)):
            calm[t] = not any(c in _OPENERS for c in ll_tokenizer.decode_bytes([t]))
        self.calm_bits = np.packbits(calm, bitorder="little").view(np.int32)


_vocabs: dict[int, ClosingVocab] = {}
_vocabs_lock = threading.Lock()


def closing_vocab(ll_tokenizer: Any, n_vocab: int) -> ClosingVocab:
    with _vocabs_lock:
        v = _vocabs.get(id(ll_tokenizer))
        if v is None:
            v = _vocabs[id(ll_tokenizer)] = ClosingVocab(ll_tokenizer, n_vocab)
        return v


class StartMemo:
    """What a constrained row starts from depends only on the tokenizer and the grammar: kept
    for the grammars seen last, so that a burst of requests with one schema (an app's response
    format, an agent's tool) computes it once. A guard's closing search walks the grammar a
    byte at a time in Python with the GIL held (up to `_LIMIT_BYTES`: ~0.1 s where no closing
    is found), and a grammar's matcher takes ~1 ms to build (a copy of one: µs), both on the
    admission lanes beside the MLX thread. `owner` (the tokenizer, or its closing vocabulary)
    is held with each value, so a new object at a freed one's address never takes its
    values."""

    SIZE = 64

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: OrderedDict[tuple[int, str, str], tuple[object, Any]] = OrderedDict()

    def get(self, owner: object, grammar: str, what: str, compute: Any) -> Any:
        key = (id(owner), grammar, what)
        with self._lock:
            held = self._items.get(key)
            if held is not None and held[0] is owner:
                self._items.move_to_end(key)
                return held[1]
        value = compute()  # outside the lock: two lanes may both compute it once
        with self._lock:
            self._items[key] = (owner, value)
            self._items.move_to_end(key)
            while len(self._items) > self.SIZE:
                self._items.popitem(last=False)
        return value


start_memo = StartMemo()


class Decision:
    """One step's word on a row: force one token, or keep the grammar's mask (restricted to
    calm tokens plus `first` when `near`)."""
    __slots__ = ("force", "near", "first")

    def __init__(self, force: int | None = None, near: bool = False,
                 first: int | None = None) -> None:
        self.force, self.near, self.first = force, near, first


FREE = Decision()


class BudgetGuard:
    """One constrained row's budget. `history` is the list the row's token feed appends every
    consumed token to (replayed ones first)."""

    def __init__(self, vocab: ClosingVocab, matcher: Any, max_tokens: int,
                 history: list[int], grammar: str | None = None) -> None:
        self.vocab, self.matcher, self.max_tokens = vocab, matcher, max_tokens
        self.history = history
        self._closing: tuple[int, list[int]] | None = None  # (position, closing) last found
        self._lex = JsonLex()
        self._lexed = 0
        self._queue: list[int] = []
        self._decided: tuple[int, Decision] | None = None
        self.closing_started_at: int | None = None  # where the budget first took a choice
        self._committed = False  # the closing is forced to its end
        if grammar is not None and not history:  # at the start: as every request before
            first = start_memo.get(vocab, grammar, "closing", self._closing_tokens)
            first = None if first is None else list(first)
        else:
            first = self._closing_tokens()
        self._start = first  # the closing while nothing is consumed yet
        self.shortest = len(first) if first is not None else None
        # whether the budget can hold the shortest document at all (else the row is cut)
        self.fits = self.shortest is not None and self.shortest <= max_tokens
        self._last = self.shortest or 0
        self._checked_at = 0
        self.calm = CALM
        if grammar is not None and self.fits:
            self.calm = max(CALM, start_memo.get(vocab, grammar, "widest",
                                                 lambda: self._widest_jump(grammar)))

    def _widest_jump(self, grammar: str) -> int:
        """The shortest document of the schema with everything optional made required: one
        token opening a heavy optional key (`"when":` whose object has required keys of its
        own) can add that much to the closing at once, so the calm mode starts that far out."""
        import llguidance
        try:
            full = llguidance.LLMatcher.grammar_from_json_schema(
                fully_required(schema_of(grammar)), defaults={"whitespace_flexible": False})
            m = llguidance.LLMatcher(self.vocab.ll, full)
            if m.is_error():
                return 0
            byte_token = self.vocab.byte_token

            def accept(b: int) -> bool:
                t = byte_token.get(b)
                return t is not None and m.try_consume_tokens([t]) == 1
            found = closing(JsonLex(), accept, m.is_accepting, _LIMIT_BYTES)
        except (ValueError, KeyError, TypeError, RuntimeError):
            return 0  # a schema the widening breaks: the default width
        return 0 if found is None else len(self.vocab.ll.tokenize_bytes(found))

    @property
    def closed_for_budget(self) -> bool:
        return self.closing_started_at is not None

    def decide(self, position: int) -> Decision:
        """The word for generated `position` (the same if asked twice)."""
        if self._decided is not None and self._decided[0] == position:
            return self._decided[1]
        d = self._decide(position)
        self._decided = (position, d)
        return d

    def _decide(self, position: int) -> Decision:
        left = self.max_tokens - position
        if self._queue:
            t = self._queue.pop(0)
            if self.matcher.validate_tokens([t]) == 1:
                return self._force(t, position)
            self._queue = []  # should not happen: search again from here
        elif self._committed:
            return FREE  # closed: the grammar allows only the end now
        if left - GROWTH * (position - self._checked_at) > self._last + self.calm:
            return FREE  # even at the fastest growth the closing cannot be near yet
        tokens = self._next_closing(position)
        self._checked_at = position
        if not tokens:  # complete already, or no closing found: the grammar alone
            return FREE
        self._last = len(tokens)
        slack, lex = left - len(tokens), self._lex
        if slack <= MARGIN:
            if len(tokens) > left:
                log.warning("a constrained row's closing (%d tokens) no longer fits its %d "
                            "tokens left: it will be cut", len(tokens), left)
            self._committed = True
            self._queue = tokens[1:]
            return self._force(tokens[0], position)
        if slack > self.calm:
            return FREE
        if (slack <= NEAR and not lex.in_value) or lex.in_key \
                or (lex.key_next and not lex.in_string):
            # the closing's next step (its key, its shortest value's start), then the row
            # fills the value in
            return self._force(tokens[0], position)
        return Decision(near=True, first=tokens[0])

    def _force(self, token: int, position: int) -> Decision:
        """Force `token`; the budget took a choice from the row unless the grammar itself
        forces the same bytes here."""
        if self.closing_started_at is None:
            mine = self.vocab.ll.decode_bytes([token])
            if not self.matcher.compute_ff_bytes().startswith(mine):
                self.closing_started_at = position
        return Decision(force=token)

    def _next_closing(self, position: int) -> list[int] | None:
        """The closing from here: the last one less its first token when the row took that
        token (what happens every step once it is forced), else searched again."""
        was = self._closing
        if was is not None and was[0] == position - 1 and was[1] \
                and self.history and self.history[-1] == was[1][0]:
            self._catch_up()
            tokens: list[int] | None = was[1][1:]
        elif not self.history and self._start is not None:
            tokens = list(self._start)
        else:
            tokens = self._closing_tokens()
        self._closing = (position, tokens) if tokens else None
        return tokens

    def _closing_tokens(self) -> list[int] | None:
        """Tokens that finish the document from the matcher's state (checked by it)."""
        if self.matcher.is_error():
            return None
        self._catch_up()
        scratch = self.matcher.deep_copy()
        byte_token = self.vocab.byte_token

        def accept(b: int) -> bool:
            t = byte_token.get(b)
            return t is not None and scratch.try_consume_tokens([t]) == 1
        found = closing(self._lex, accept, scratch.is_accepting, _LIMIT_BYTES)
        if found is None:
            return None
        if not found:
            return []
        ll = self.vocab.ll
        tokens = ll.tokenize_bytes(found)
        if ll.decode_bytes(tokens) == found \
                and self.matcher.validate_tokens(tokens) == len(tokens):
            return tokens
        return [byte_token[b] for b in found]  # the search's own tokens: valid by construction

    def _catch_up(self) -> None:
        new = self.history[self._lexed:]
        if new:
            self._lex.feed(self.vocab.ll.decode_bytes(new))
            self._lexed = len(self.history)


def apply(decision: Decision, bits: np.ndarray, row: int, vocab: ClosingVocab) -> None:
    """Write `decision` into row `row` of a step's packed bitmask (already filled by the
    grammar unless the token is forced)."""
    words = bits.view(np.uint32)
    if decision.force is not None:
        t = decision.force
        words[row] = 0
        words[row, t >> 5] = np.uint32(1 << (t & 31))
    elif decision.near:
        bits[row] &= vocab.calm_bits[:bits.shape[1]]
        if decision.first is not None:
            t = decision.first
            words[row, t >> 5] |= np.uint32(1 << (t & 31))
