"""Which inputs an embedding forward pass holds, and how long a pass may be. Pure policy
(`batching.py` applies it on the MLX thread).

A pass was bounded by inputs and padded tokens only, so on slow hardware one pass took
minutes: a causal LM's passes run between its generation steps, and its chat streams waited
that long between two tokens; an aborted request's pass ran to its end. Now a pass is also
bounded by time, as a prefill chunk is (`batch/timing/chunking.py`: the same step target, a
quarter of `--hang-timeout`, at most 2 s): inputs are grouped up to the padded tokens that fit
in it at the rate last seen, and a causal LM's input longer than that is embedded a chunk a
pass through a KV cache (its mean-pooled hidden states are the same: each position attends to
the ones before it, cached or in the same pass). An encoder's input attends both ways and
cannot be cut: it has a pass of its own, however long (the watchdog waits by the pass's pace).
"""

from __future__ import annotations

from mlxd.engine.batch.timing.chunking import FLOOR, IDLE_STEP

MAX_STEP_INPUTS = 64  # inputs embedded in one forward pass at most
MAX_STEP_TOKENS = 32768  # padded tokens (inputs x the longest of them) in one forward pass
# a causal input's chunk before any pass has been timed (`--no-warm-up`): mlx-lm's prefill chunk
UNTIMED_CHUNK = IDLE_STEP
TIME_SHARE = 0.8  # of the target: the next pass attends over a little more than the last


def pass_tokens(target_s: float, token_s: float | None) -> int:
    """Padded tokens one pass may hold to last about `target_s` at `token_s` seconds a padded
    token (None: not timed yet, so bounded by tokens alone)."""
    if not token_s or token_s <= 0 or target_s <= 0:
        return MAX_STEP_TOKENS
    return max(FLOOR, min(MAX_STEP_TOKENS, int(target_s * TIME_SHARE / token_s)))


def chunk_tokens(target_s: float, token_s: float | None) -> int:
    """A chunk of a causal LM's long input: what fits in a pass, at most mlx-lm's prefill chunk
    (a longer one only costs memory: its attention scores grow with it)."""
    if not token_s or token_s <= 0:
        return UNTIMED_CHUNK
    return min(IDLE_STEP, pass_tokens(target_s, token_s))


def plan_steps(lengths: list[int], max_inputs: int = MAX_STEP_INPUTS,
               max_tokens: int = MAX_STEP_TOKENS) -> list[list[int]]:
    """Indices of `lengths` grouped into forward passes: similar lengths together (less
    padding), at most `max_inputs` per pass and `max_tokens` padded tokens (one input longer
    than that still gets a pass of its own)."""
    steps: list[list[int]] = []
    step: list[int] = []
    longest = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        longest_if = max(longest, lengths[i])
        if step and (len(step) >= max_inputs or (len(step) + 1) * longest_if > max_tokens):
            steps.append(step)
            step, longest_if = [], lengths[i]
        step.append(i)
        longest = longest_if
    if step:
        steps.append(step)
    return steps
