"""Volatile prompt lines (`--volatile-line`, opt-in): lines of a system prompt that change on
every request although nothing else does, dropped before tokenization so that the prefix cache
keeps matching past them. Claude Code's system prompt carries one (an
`x-anthropic-billing-header: ...; cch=<hash>` line near the top): left in, every turn of a
session misses the cache a few hundred tokens in and prefills its whole context again. Pure,
runs in the proxy; only system messages are touched, only the lines the user named."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from mlxd.protocol.volatile_lines import compile_patterns

__all__ = ["VolatileLines", "compile_patterns"]

@dataclass
class VolatileLines:
    pattern: re.Pattern[str] | None
    dropped: int = 0  # lines dropped so far (for /stats)
    requests: int = 0  # requests that had one
    _seen: set[str] = field(default_factory=set)

    def scrub(self, messages: list[dict] | None) -> list[dict] | None:
        """`messages` with the volatile lines of their system messages removed (a new list,
        the request's own dicts untouched)."""
        if self.pattern is None or not messages:
            return messages
        out, n = [], 0
        for m in messages:
            if m.get("role") == "system":
                content = m.get("content")
                if isinstance(content, str):
                    content, k = self.pattern.subn("", content)
                    n += k
                elif isinstance(content, list):
                    parts = []
                    for p in content:
                        if isinstance(p, dict) and isinstance(p.get("text"), str):
                            text, k = self.pattern.subn("", p["text"])
                            n += k
                            p = {**p, "text": text}
                        parts.append(p)
                    content = parts
                m = {**m, "content": content}
            out.append(m)
        if n:
            self.dropped += n
            self.requests += 1
        return out
