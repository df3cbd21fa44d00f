"""How many prompt tokens one step prefills. Pure policy (the runner applies it).

A step of mlx-lm's `BatchGenerator` decodes one token for every running row and prefills one
chunk of waiting prompts, and the hang watchdog counts steps as the engine's progress. With a
fixed chunk, a slow machine (a CPU, a large model, a long context: attention grows with it)
can spend longer on one chunk than `--hang-timeout`, and the watchdog then kills an engine that
was working, over and over, and running streams wait that long between tokens. So the chunk
is bounded by time as well as by `--prefill-step`: after each step that prefilled, the chunk
is set so that a step at the rate just seen lasts at most `target_s`
(`step_target`: a quarter of the hang timeout, at most 2 s; a steady, reachable bound on the
gap between two tokens of a running stream while prompts prefill). It grows back at most 2x a
step (from `START` at first, or less where the warm-up's rate says `START` would outlast the
bound), so one fast reading does not overshoot, and never falls below `FLOOR` (where even that
outlasts the bound, the engine's stated pace keeps the watchdog patient: `pace.py`). A fast
device never meets the bound and reaches `--prefill-step` within a few steps.

`--prefill-step` bounds a chunk only while rows decode: it is what they wait between two tokens.
With no row decoding (an agent's next turn, a lone chat) nothing waits, and a step prefills up to
`IDLE_STEP` (or `--prefill-step`, if larger), mlx-lm's own chunk, shared by the prompts
prefilled together (a burst's step is no larger than with `--prefill-step` each): a long prompt
then costs as few steps as in-process mlx-lm, each step's fixed cost (the forward pass's
dispatch, the batch's bookkeeping) paid a quarter as often.
"""

from __future__ import annotations

FLOOR = 16  # tokens: below this a step's fixed costs dominate
START = 64  # the first steps' chunk, before any is timed (doubling from there on fast ones)
IDLE_STEP = 2048  # mlx-lm's prefill_step_size (generate_step, mlx_lm.server, BatchGenerator)
MAX_TARGET_S = 2.0


def step_target(hang_timeout: float) -> float:
    """Seconds a prefilling step may take: well inside the hang timeout (0: none)."""
    return min(MAX_TARGET_S, hang_timeout / 4) if hang_timeout > 0 else MAX_TARGET_S


class PrefillChunks:
    def __init__(self, configured: int, target_s: float, idle_step: int = IDLE_STEP,
                 token_s: float | None = None) -> None:
        """`token_s`: seconds per prompt token measured before the first step (the engine's
        warm-up), where known: a first chunk it says would outlast the target starts smaller
        (down to `FLOOR`)."""
        self.configured = configured  # --prefill-step: the most a step prefills while rows decode
        self.most = max(configured, idle_step)  # the most a step ever prefills
        self.target_s = target_s
        self.chunk = min(configured, START)  # what the time bound allows (<= most)
        if token_s:
            self.chunk = max(FLOOR, min(self.chunk, int(target_s * 0.8 / token_s)))

    def for_step(self, decoding: bool, prompts: int = 1) -> int:
        """Each prompt's chunk for a step that starts with rows decoding (or with none) and
        `prompts` prompts to prefill: with none decoding, the prompts share `most` (a burst
        of them is no larger a step than before: `--prefill-step` each)."""
        if decoding:
            return min(self.chunk, self.configured)
        return min(self.chunk, max(self.configured, self.most // max(1, prompts)))

    def observe(self, prefilled: int, seconds: float) -> int:
        """A step prefilled `prefilled` tokens (all rows) in `seconds` (its whole time): the
        chunk for the next steps."""
        if prefilled <= 0 or seconds <= 0:
            return self.chunk
        # 0.8: attention grows with the context, so the next chunk costs a little more
        fits = int(prefilled / seconds * self.target_s * 0.8)
        self.chunk = max(FLOOR, min(self.most, fits, 2 * self.chunk))
        return self.chunk
