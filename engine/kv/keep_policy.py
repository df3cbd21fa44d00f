"""What the RAM tier keeps when it is full: the work a client comes back to (an agent's next
turn, subagents sharing a system prompt, a chat's next message) ahead of one-off prompts. Pure
decisions, no MLX; `prefix_cache.py` applies them.

A coding agent's session re-sends its whole conversation every turn, grown by the model's
answer and a tool result. Each finished turn's history is an entry holding KV for every one of
its tokens, so the previous turn's entry is, but for its last few tokens (the answer as the
client renders it back may differ from the tokens generated), a prefix of the new one: it can
serve nothing the new one cannot, yet held as its own copy it doubles what a session costs.
Such an entry is *superseded* and dropped at once. What stays then is, per session, its latest
turn; the prefix they share (the system prompt and tools) is served by any of them.

Entries are then of two classes. An entry is *kept* (a session's) when it served a hit that
continued earlier work, or when it was built by a request that did (started from a prefix of at
least half its prompt, from the RAM or the SSD tier), or when it superseded a kept one. Other
entries (a title request, an unrelated prompt) are *one-offs*. Eviction takes one-offs first,
least recently used first, then kept entries the same way; an evicted entry goes to the SSD tier
first (if there is one) and comes back into RAM when a prompt is served from it.
"""

from __future__ import annotations

# An entry whose tokens, but for at most this many at its end, begin a newer entry is dropped
# for it: a later prompt that needed exactly those last tokens prefills at most this many.
SUPERSEDE_SLACK = 64

# A prefix this short (a chat template's opening, a shared first line) is no sign of a session.
CONTINUE_MIN = 32


def continues(served: int, prompt_len: int) -> bool:
    """Whether a request whose first `served` tokens came from a tier continues earlier work
    rather than being a one-off: at least half of its prompt, and CONTINUE_MIN tokens."""
    return served >= CONTINUE_MIN and 2 * served >= prompt_len


def supersedes(new_len: int, old_len: int, common: int) -> bool:
    """Whether a new entry of `new_len` tokens supersedes an old one of `old_len` tokens, the
    two sharing their first `common` tokens: it is no shorter, and all but at most
    SUPERSEDE_SLACK of the old one's tokens, and at least half of them, are among the shared
    ones (a short entry is not dropped for an unrelated long one)."""
    return (new_len >= old_len and common >= old_len - SUPERSEDE_SLACK
            and 2 * common >= old_len)
