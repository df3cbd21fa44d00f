"""What an error may tell any client: no file-system paths. A model's load error names files
(`/Users/<name>/models/.../config.json`); the API answers every TCP client, so a path in it is
cut to its last part. The supervisor's log keeps the whole message."""

from __future__ import annotations

import re

# an absolute path of two or more parts (POSIX; `~/` too), up to whitespace, a quote or a bracket
_PATH = re.compile(r"(?<![\w.:/])(?:~|/[^\s/'\"()\[\]{},;:]+)(?:/[^\s/'\"()\[\]{},;:]+)+/?")


def without_paths(text: str) -> str:
    """`text` with every absolute path replaced by `.../<its last part>`."""
    def last(m: re.Match[str]) -> str:
        parts = [p for p in m.group(0).split("/") if p]
        return ".../" + parts[-1] if parts else m.group(0)
    return _PATH.sub(last, text)
