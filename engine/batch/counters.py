"""The runner's figures: advanced on the MLX thread, read by the output thread for the
engine's status and by the I/O thread for the hang watchdog (plain numbers: a read is never
torn)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RunnerCounters:
    steps: int = 0  # advanced by every step: the hang watchdog's progress counter
    peak_batch: int = 0
    prompt_tokens: int = 0
    prefilled_tokens: int = 0  # prompt tokens computed (chunk by chunk, as they are)
    cached_tokens: int = 0
    ssd_restored_tokens: int = 0
    generated_tokens: int = 0
    checkpoints: int = 0
    checkpoint_s: float = 0.0  # MLX-thread time spent taking checkpoints
    first_tokens: int = 0  # requests that produced their first token (for the means below)
    to_admit_s: float = 0.0  # sum over them: engine receipt -> inserted into the batch
    to_first_token_s: float = 0.0  # sum over them: engine receipt -> first token sampled
    step_s: float = 0.0  # MLX-thread time in generation steps, checkpoints included
    longest_step_s: float = 0.0  # the longest of them
    active: int = 0
    busy: bool = False
    pace_s: float = 0.0  # how long a step takes now (batch/timing/pace.py): the watchdog's patience
    batch_cap: int = 0  # rows the budget allows now (see budget.explain)
    batch_why: str = ""
    waiting: int = 0  # requests held back until rows finish
    bursts: int = 0  # inserts of two or more requests gathered together while idle
