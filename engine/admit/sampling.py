"""Samplers and logits processors built from mlx-lm's, with per-request, per-position seeding.

A seeded request's draw at generated position k depends only on (seed, k), so a request
continued from position k samples what the uninterrupted one would have.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
)

from mlxd.protocol.messages import SamplingParams

_MASK64 = (1 << 64) - 1


def _mix(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): a well-spread key per draw."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def make_request_sampler(p: SamplingParams,
                         start_position: int = 0) -> Callable[[mx.array], mx.array]:
    if p.temperature <= 0:
        return greedy_sampler  # one shared object: greedy rows are sampled in one batched call
    methods: list[Callable[[mx.array], mx.array]] = []
    if 0 < p.top_p < 1.0:
        methods.append(lambda x: apply_top_p(x, p.top_p))
    if p.min_p > 0:
        methods.append(lambda x: apply_min_p(x, p.min_p, 1))
    if p.top_k > 0:  # a top_k of the vocabulary or more keeps every token: no filter
        methods.append(lambda x: apply_top_k(x, p.top_k) if p.top_k < x.shape[-1] else x)
    inv_temp = 1.0 / p.temperature
    position = [start_position]

    def sampler(logprobs: mx.array) -> mx.array:
        for method in methods:
            logprobs = method(logprobs)
        key = mx.random.key(_mix(p.seed, position[0]))
        position[0] += 1
        return mx.random.categorical(logprobs * inv_temp, key=key)

    return sampler


def make_request_processors(p: SamplingParams) -> list:
    return make_logits_processors(
        logit_bias=p.logit_bias or None,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty != 1.0 else None,
        presence_penalty=p.presence_penalty or None,
        frequency_penalty=p.frequency_penalty or None)
