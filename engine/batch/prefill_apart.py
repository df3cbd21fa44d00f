"""Which waiting prompts join the prompt batch this step, when some prompt has a long context
(the `prefill_alone_from` setting): pure.

mlx-lm prefills the prompts it admits together as one batch, each row's cache left-padded to the
longest context and attended with an array mask. Two prompts over long contexts (two agent
sessions' next turns) then each attend over the longer context, and on CUDA in the unfused
kernels: prefilled apart, each is one sequence with a causal mask (benchmarks/RESULTS.md, "Two
sessions: a long prompt prefills alone"). A short prompt is never held back for that: it joins
the batch at once, next to at most one long prompt, and leaves it for decoding within a step or
two (a few steps of padding for the long one), where holding it would keep a chat's first
token waiting for the whole of an agent's prefill (minutes for a long context on a slow
machine). Short waiting prompts go ahead of long ones; a long one starts as soon as no other
long one is being prefilled, so none waits for ever behind a stream of short ones.
"""

from __future__ import annotations


def plan(prefilling: list[int], waiting: list[int], threshold: int, batch_size: int
         ) -> tuple[list[int], int]:
    """(the waiting prompts' order, as indices into `waiting`; the prompt batch's size for
    this step) from the contexts (cached and prompt tokens) of the prompts being prefilled and
    of those waiting, in their order. `threshold` 0: mlx-lm's batching, unchanged."""
    order = list(range(len(waiting)))
    if threshold <= 0 or not any(c >= threshold for c in prefilling + waiting):
        return order, batch_size
    short = [i for i in order if waiting[i] < threshold]
    long = [i for i in order if waiting[i] >= threshold]
    long_in = any(c >= threshold for c in prefilling)
    joining = len(short) + (0 if long_in or not long else 1)
    return short + long, min(batch_size, len(prefilling) + joining)
