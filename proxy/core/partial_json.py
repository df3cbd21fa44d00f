"""JSON cut short, made whole (pure; runs in the proxy): a forced tool call that the length
limit cut off still comes back as a call, with the arguments written so far.

`complete` keeps every member and element that was finished, and a string value cut inside
(closed where it stopped); it drops a key without its value and a number or literal that may
be incomplete only when keeping it would not parse."""

from __future__ import annotations

import json
import re
from typing import Any

_PARTIAL_UNICODE = re.compile(r"\\u[0-9a-fA-F]{0,3}$")
_CLOSERS = {"{": "}", "[": "]"}


def complete(text: str) -> Any:
    """The value `text` starts, closed where it stops; None if not even that can be had."""
    text = text.strip()
    try:
        return json.loads(text)
    except ValueError:
        pass
    stack: list[str] = []  # open containers, "{" or "["
    expect_key: list[bool] = []  # per open object: a key comes next (not a value)
    safe: tuple[int, tuple[str, ...]] | None = None  # a cut that parses, and its open containers
    in_string = escaped = False
    string_is_key = False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if string_is_key:
                    expect_key[-1] = False
                else:
                    safe = (i + 1, tuple(stack))
            continue
        if ch == '"':
            in_string = True
            string_is_key = bool(stack) and stack[-1] == "{" and expect_key[-1]
        elif ch in "{[":
            stack.append(ch)
            expect_key.append(ch == "{")
            safe = (i + 1, tuple(stack))
        elif ch in "}]":
            if not stack:
                break
            stack.pop()
            expect_key.pop()
            safe = (i + 1, tuple(stack))
        elif ch == ",":
            safe = (i, tuple(stack))
            if stack and stack[-1] == "{":
                expect_key[-1] = True
    tail = text
    if in_string:  # close it, without half an escape sequence
        tail = (tail[:-1] if escaped else _PARTIAL_UNICODE.sub("", tail)) + '"'
    for candidate in (tail + _close(stack), _cut(text, safe)):
        if candidate is None:
            continue
        try:
            return json.loads(candidate)
        except ValueError:
            continue
    return None


def _close(stack: list[str] | tuple[str, ...]) -> str:
    return "".join(_CLOSERS[c] for c in reversed(stack))


def _cut(text: str, safe: tuple[int, tuple[str, ...]] | None) -> str | None:
    if safe is None:
        return None
    end, stack = safe
    return text[:end].rstrip().rstrip(",") + _close(stack)
