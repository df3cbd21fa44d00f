"""The shortest way to finish a JSON document that a grammar has started: pure logic, no model.

A constrained row whose token budget runs out mid-document would end as invalid JSON. Its
grammar (llguidance's, from a JSON schema) already knows what may follow; what it cannot say is
which continuation is shortest. `closing` finds one greedily, a byte at a time: it offers the
grammar the bytes that finish JSON soonest from the current lexical state (close the string,
close the container, the shortest scalar), in that order, and keeps the first one the grammar
accepts, until the grammar accepts the whole document. The grammar vets every byte, so what
comes out is always valid for the schema (required keys, minItems, minLength, enums, number
bounds are the grammar's business); the lexical state only orders the candidates, which keeps
the search short and keeps it from looping (a number is ended rather than extended, a string
closed rather than filled).
"""

from __future__ import annotations

import string
from collections.abc import Callable
from dataclasses import dataclass

_PRINTABLE = bytes(string.printable, "ascii")


def _order(first: bytes) -> bytes:
    """`first`, then every other printable ASCII byte (a last resort for odd grammars)."""
    return first + bytes(b for b in _PRINTABLE if b not in first)


_ALNUM = b"abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ_"
# Outside a string: close what is open, else separate, else the shortest value.
_STRUCTURAL = _order(b'}],:0"123456789-tfn[{.')
_IN_NUMBER = _order(b"}],0123456789.eE-+")  # end the number before growing it
_IN_LITERAL = _order(b"}],aelnrstu")  # true/false/null: the grammar picks the one letter
_IN_STRING = _order(b'"' + _ALNUM)
_IN_ESCAPE = _order(b'"\\/bfnrtu')
_IN_UNICODE = _order(b"0123456789abcdefABCDEF")
_CONTINUATION = bytes(range(0x80, 0xC0))  # the rest of a UTF-8 character cut by a token


@dataclass
class JsonLex:
    """Where a JSON text stands lexically: in a string (an escape, a \\u escape), in a number,
    in a literal, or between tokens. Fed bytes as they are generated."""
    in_string: bool = False
    escape: bool = False
    unicode_left: int = 0  # hex digits still due in a \\u escape
    utf8_left: int = 0  # continuation bytes still due in a string's UTF-8 character
    scalar: str = ""  # "number" or "literal" while one is being written outside a string
    stack: str = ""  # the open containers, "{" and "["
    key_next: bool = False  # the next string is an object's key
    in_key: bool = False  # the string being written is a key

    def copy(self) -> JsonLex:
        return JsonLex(self.in_string, self.escape, self.unicode_left, self.utf8_left,
                       self.scalar, self.stack, self.key_next, self.in_key)

    @property
    def in_value(self) -> bool:
        """Inside a string value or a number: what is written here only fills the value."""
        return (self.in_string and not self.in_key) or self.scalar == "number"

    def feed(self, data: bytes) -> None:
        for b in data:
            if self.in_string:
                if self.utf8_left and 0x80 <= b < 0xC0:
                    self.utf8_left -= 1
                elif b >= 0xC0:
                    self.utf8_left = 1 if b < 0xE0 else 2 if b < 0xF0 else 3
                elif self.unicode_left:
                    self.unicode_left -= 1
                elif self.escape:
                    self.escape = False
                    if b == 0x75:  # u
                        self.unicode_left = 4
                elif b == 0x5C:  # backslash
                    self.escape = True
                elif b == 0x22:  # quote
                    self.in_string = False
            elif b == 0x22:
                self.in_string, self.scalar = True, ""
                self.in_key, self.key_next = self.key_next, False
            elif b in b"0123456789-+.eE" and self.scalar != "literal":
                self.scalar = "number"
            elif 0x61 <= b <= 0x7A:  # a-z outside a string: true, false, null
                self.scalar = "literal"
            else:
                self.scalar = ""
                self._structure(b)

    def _structure(self, b: int) -> None:
        if b == 0x7B:  # {
            self.stack += "{"
            self.key_next = True
        elif b == 0x5B:  # [
            self.stack += "["
            self.key_next = False
        elif b in (0x7D, 0x5D):  # } ]
            self.stack = self.stack[:-1]
            self.key_next = False
        elif b == 0x2C:  # ,
            self.key_next = self.stack.endswith("{")
        elif b == 0x3A:  # :
            self.key_next = False

    def candidates(self) -> bytes:
        """The next bytes worth offering the grammar, the ones that finish soonest first."""
        if self.in_string:
            if self.utf8_left:
                return _CONTINUATION
            if self.unicode_left:
                return _IN_UNICODE
            return _IN_ESCAPE if self.escape else _IN_STRING
        if self.scalar == "number":
            return _IN_NUMBER
        if self.scalar == "literal":
            return _IN_LITERAL
        return _STRUCTURAL


def closing(lex: JsonLex, accept: Callable[[int], bool], done: Callable[[], bool],
            limit: int) -> bytes | None:
    """The bytes that finish the document: `accept(byte)` offers the grammar one byte (and
    keeps it if it is allowed), `done()` says whether the grammar accepts the document as it
    stands. None if no end was found within `limit` bytes (a grammar the order above cannot
    finish, such as a pattern it keeps going round)."""
    lex = lex.copy()
    out = bytearray()
    while not done():
        if len(out) >= limit:
            return None
        for b in lex.candidates():
            if accept(b):
                out.append(b)
                lex.feed(bytes((b,)))
                break
        else:
            return None
    return bytes(out)
