"""`--volatile-line`'s patterns (proxy/core/volatile.py drops the lines): the presets and
how the values given become one expression; the config checks them at start."""

from __future__ import annotations

import re

# named patterns a user may give instead of a regular expression
PRESETS = {"claude-code": r"x-anthropic-billing-header:.*"}


def compile_patterns(values: list[str]) -> re.Pattern[str] | None:
    """One expression matching a whole line that any of `values` (a preset name or a regular
    expression) matches; None for none. Raises re.error for a bad expression."""
    if not values:
        return None
    parts = [f"(?:{PRESETS.get(v, v)})" for v in values]
    return re.compile(r"^[ \t]*(?:" + "|".join(parts) + r")[ \t]*(?:\r?\n|$)", re.MULTILINE)
