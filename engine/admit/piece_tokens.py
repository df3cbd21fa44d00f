"""A chat prompt tokenized piece by piece, each piece's tokens kept: a conversation re-sent with
one more turn costs the tokenizing of that turn, not of the whole conversation again (a coding
agent's 50k-token context took tens of milliseconds a turn, the same order as prefilling the new
turn on a GPU).

A fast (Rust) tokenizer splits its input at its added tokens (`<|im_start|>` and the like)
before anything else, and normalizes and pre-tokenizes each part on its own, so the tokens of a
rendered chat prompt are the tokens of its parts between added tokens, in order. That holds
unless an added token strips the whitespace beside it (`lstrip`/`rstrip`) or must stand alone
as a word (`single_word`), or the pre-tokenizer treats the first part of the input unlike the
others (a Metaspace prefix space "first"): such tokenizers are not split. And the first
prompts of every tokenizer are also tokenized whole and compared (`VERIFY`): any difference
turns the pieces off for that model, with one line in the log, before a wrong token is used.

Admission lanes call it from several threads: the kept pieces are behind a lock; tokenizing
happens outside it.
"""

from __future__ import annotations

import logging
import re
import threading
from array import array
from collections import OrderedDict
from typing import Any

log = logging.getLogger(__name__)

VERIFY = 4  # prompts tokenized both ways and compared before the pieces are trusted
# characters of text whose pieces are kept, least recently used going first: 32 MiB of text
# and ~4 bytes a token for its ids (an agent context of 250 kB is about 1 % of it)
KEEP_CHARS = 32 << 20
MIN_KEPT = 256  # a shorter piece is tokenized each time (cheaper than keeping it)


class PieceTokenizer:
    def __init__(self, backend: Any) -> None:
        """`backend`: a `tokenizers.Tokenizer` (a fast tokenizer's `backend_tokenizer`)."""
        self.backend = backend
        added = backend.get_added_tokens_decoder()  # id -> AddedToken
        self.ids = {t.content: i for i, t in added.items()}
        contents = sorted(self.ids, key=len, reverse=True)
        self.split = re.compile("(" + "|".join(map(re.escape, contents)) + ")") if contents \
            else None
        self._kept: OrderedDict[str, array[int]] = OrderedDict()  # ids as 32-bit values
        self._kept_chars = 0
        self._lock = threading.Lock()
        self.verified = 0
        self.on = True

    @classmethod
    def for_tokenizer(cls, hf: Any) -> PieceTokenizer | None:
        """For a transformers fast tokenizer whose added tokens and pre-tokenizer allow it
        (module text); None otherwise."""
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None or not hasattr(backend, "get_added_tokens_decoder"):
            return None
        for t in backend.get_added_tokens_decoder().values():
            if t.lstrip or t.rstrip or t.single_word:
                return None
        if "first" in repr(backend.pre_tokenizer).lower() or \
                "prepend" in repr(backend.normalizer).lower():
            return None  # a prefix added to the input's first part only, or to every part
        return cls(backend)

    def encode(self, text: str) -> list[int]:
        """The tokens of `text` without the tokenizer's own added BOS/EOS (as a chat template's
        rendering is tokenized)."""
        parts = self.split.split(text) if self.split is not None else [text]
        out: list[int] = []
        missing: list[str] = []
        with self._lock:
            got: list[array[int] | list[int] | None] = []
            for i, part in enumerate(parts):
                if i % 2:  # an added token, captured by the split
                    got.append([self.ids[part]])
                elif not part:
                    got.append([])
                else:
                    kept = self._kept.get(part)
                    if kept is not None:
                        self._kept.move_to_end(part)
                    else:
                        missing.append(part)
                    got.append(kept)
        new = dict(zip(missing, (e.ids for e in self.backend.encode_batch(
            missing, add_special_tokens=False)), strict=True)) if missing else {}
        for part, piece in zip(parts, got, strict=True):
            out += piece if piece is not None else new[part]
        if new:
            self._keep(new)
        return out

    def _keep(self, new: dict[str, list[int]]) -> None:
        with self._lock:
            for part, ids in new.items():
                if len(part) >= MIN_KEPT and part not in self._kept:
                    self._kept[part] = array("I", ids)
                    self._kept_chars += len(part)
            while self._kept_chars > KEEP_CHARS and self._kept:
                part, _ = self._kept.popitem(last=False)
                self._kept_chars -= len(part)

    def checked(self, text: str) -> list[int] | None:
        """`encode(text)`, or None when the pieces are off. While fewer than VERIFY prompts
        have been compared, the whole text is tokenized too: a difference turns them off."""
        if not self.on:
            return None
        ids = self.encode(text)
        if self.verified < VERIFY:
            # encode_batch, not encode: it lets go of the GIL (a long prompt's seconds of
            # tokenizing must not stop the engine's heartbeat thread)
            whole = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
            if whole != ids:
                self.on = False
                log.warning("this model's tokenizer gives other tokens for a prompt's parts "
                            "than for the whole prompt: prompts are tokenized whole")
                return list(whole)
            self.verified += 1
        return ids
