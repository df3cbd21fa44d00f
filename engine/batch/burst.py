"""The runner's admission rules, pure: how long an idle engine gathers a burst, and which
cached prefixes a row is lent.

- Burst admission: an idle engine that just got a request keeps gathering arrivals while they
  come within `quiet` of each other or more are being prepared (template, tokens) on the small
  admission lane, for `window` of arrivals at most; requests that reached the engine within
  that window and are still being prepared are waited for up to `prepare` more (a small CPU
  prepares a burst more slowly than the window). Then they are prefilled as one batch. The
  hidden setting `burst_window` ("QUIET_MS,WINDOW_MS[,PREPARE_MS]") sets them.
- Lending: rows admitted together prefill as one padded batch. On a GPU that prefill of short
  prompts is bound by kernel launches more than by the tokens it computes, while a lent prefix
  costs a per-row, per-layer merge into the batch's cache; so a GPU lends rows admitted
  together only hits of `GROUP_MIN_CACHED_GPU` tokens or more (benchmarks/RESULTS.md, "Burst
  prefill with short cached prefixes"). A lone request gets any hit (its merge is one row's),
  and so does every row on a CPU, whose prefill is bound by the tokens it computes.
"""

from __future__ import annotations

from dataclasses import dataclass

GROUP_MIN_CACHED_GPU = 64


@dataclass(frozen=True)
class BurstWindow:
    quiet: float = 0.003  # seconds
    window: float = 0.030
    prepare: float = 0.1

    @classmethod
    def parse(cls, text: str) -> BurstWindow:
        """From "QUIET_MS,WINDOW_MS[,PREPARE_MS]" (the setting's validated form)."""
        ms = [float(x) / 1e3 for x in text.split(",")]
        return cls(ms[0], ms[1], ms[2] if len(ms) == 3 else cls.prepare)


def lend_floor(rows_admitted: int, gpu: bool, min_cached: int = 0) -> int:
    """The shortest cached prefix lent to a row admitted with `rows_admitted - 1` others;
    `min_cached` (the hidden setting `min_cached_tokens`) raises it for every row."""
    if gpu and rows_admitted > 1:
        return max(min_cached, GROUP_MIN_CACHED_GPU)
    return min_cached
