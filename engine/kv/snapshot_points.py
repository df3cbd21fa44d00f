"""Where a prompt leaves snapshots of its fixed-size state layers (sliding windows, recurrent
states; `codec.py`), whose state is usable only at the exact position it was taken at. Pure.

- One token short of the prompt's end: the same prompt sent again is fed only its last token
  (a lookup always leaves one to feed), and the next turn of a conversation starts with it.
- Every `EVERY` tokens of a long prompt, at the same absolute positions whatever was cached,
  so that prompts sharing a long head (an agent's system prompt and tools) meet at one of
  them, and a restarted engine resumes a long prefill from the last one. Bounded: a
  32k-token prompt leaves 8, not one per block.
The end of each finished request's history is snapshotted too (the runner's publisher), which
is where the next turn of a conversation continues.
"""

from __future__ import annotations

EVERY = 4096  # tokens; a multiple of the default SSD block (256), so a point ends a block
# A prompt at least this long goes to the SSD tier as its prefill ends (not only when its
# request ends), so that an engine killed while it generates resumes without prefilling it
# again; a shorter one costs little to prefill again. (Models with state layers send each of
# their points as they are taken, whatever the length.)
PERSIST_MIN = 512


def snapshot_points(cached: int, prompt_len: int, every: int = EVERY) -> list[int]:
    """Positions past `cached` (what the row starts from) at which a row prefilling a prompt
    of `prompt_len` tokens stops to take a snapshot, ascending."""
    end = prompt_len - 1
    points = list(range((cached // every + 1) * every, end, every))
    if end > cached:
        points.append(end)
    return points


def segments(prompt: list[int], cached: int, points: list[int]) -> list[list[int]]:
    """The prompt's uncached tokens cut at `points` (the generator stops at each cut)."""
    cuts = [cached, *points, len(prompt)]
    return [prompt[a:b] for a, b in zip(cuts, cuts[1:], strict=False) if b > a]
