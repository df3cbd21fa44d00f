"""Sampling in no dialect's words (runs in the proxy).

Each dialect maps its own field names (OpenAI `max_completion_tokens`, Anthropic
`stop_sequences`, Ollama `options.num_predict` and `repeat_penalty`, ...) onto one
`SamplingRequest`. `check_sampling` refuses bad values before any model is touched and fills
in the defaults. `max_tokens` travels once, as the client sent it (None: not sent), and the one
rule about it and the model's context is `CheckedSampling.params_for`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from mlxd.protocol.messages import SamplingParams
from mlxd.proxy.errors import bad_request

MAX_STOP_STRINGS = 16
SEED_MASK = (1 << 63) - 1  # the engine's seeds are non-negative int64


@dataclass(frozen=True)
class Defaults:
    """What applies when a request leaves a field out (`--temp`, `--top-p`, `--top-k`,
    `--max-tokens`)."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 512


@dataclass(frozen=True, kw_only=True)
class SamplingRequest:
    """What a client asked for, whatever its dialect; None: not asked (a default applies)."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int = -1  # -1: none; k >= 0: each token's log-probability and the k most likely
    max_tokens: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit


@dataclass(frozen=True)
class CheckedSampling:
    """Sampling that passed every check needing no engine. `params.max_tokens` is the
    client's own when `max_tokens_explicit`, else the default."""
    params: SamplingParams
    max_tokens_explicit: bool

    def params_for(self, context_length: int) -> SamplingParams:
        """The parameters for an engine whose context is `context_length` tokens (0: not
        known yet). An explicit max_tokens beyond the context is the client's error; a default
        one is clamped by the engine to the context the prompt leaves."""
        max_tokens = self.params.max_tokens
        if self.max_tokens_explicit and context_length and max_tokens > context_length:
            raise bad_request(f"`max_tokens` is {max_tokens}, more than this model's context of "
                              f"{context_length} tokens", param="max_tokens")
        return self.params


def count_only() -> CheckedSampling:
    """The sampling of a request that is only tokenized (nothing is generated)."""
    return CheckedSampling(SamplingParams(max_tokens=1), max_tokens_explicit=False)


def check_sampling(req: SamplingRequest, defaults: Defaults) -> CheckedSampling:
    """Every sampling check that needs no engine, so bad input is refused before a model is
    touched; a request without a seed gets a random one."""
    temperature = defaults.temperature if req.temperature is None else req.temperature
    if not 0.0 <= temperature <= 2.0:
        raise bad_request("`temperature` must be between 0 and 2", param="temperature")
    top_p = defaults.top_p if req.top_p is None else req.top_p
    if not 0.0 < top_p <= 1.0:
        raise bad_request("`top_p` must be in (0, 1]", param="top_p")
    top_k = defaults.top_k if req.top_k is None else req.top_k
    if top_k < 0:
        raise bad_request("`top_k` must be >= 0", param="top_k")
    min_p = req.min_p or 0.0
    if not 0.0 <= min_p <= 1.0:
        raise bad_request("`min_p` must be in [0, 1]", param="min_p")
    repetition = 1.0 if req.repetition_penalty is None else req.repetition_penalty
    if not 0.0 < repetition <= 10.0:
        raise bad_request("`repetition_penalty` must be in (0, 10]", param="repetition_penalty")
    if req.max_tokens is not None and req.max_tokens < 1:
        raise bad_request(f"`max_tokens` must be at least 1, got {req.max_tokens}",
                          param="max_tokens")
    if len(req.stop) > MAX_STOP_STRINGS or any(not s for s in req.stop):
        raise bad_request(f"`stop` takes at most {MAX_STOP_STRINGS} non-empty strings",
                          param="stop")
    presence = req.presence_penalty or 0.0
    frequency = req.frequency_penalty or 0.0
    if not (-2.0 <= presence <= 2.0 and -2.0 <= frequency <= 2.0):
        raise bad_request("`presence_penalty` and `frequency_penalty` must be in [-2, 2]")
    seed = req.seed if req.seed is not None else random.getrandbits(63)
    params = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=repetition, seed=seed & SEED_MASK,
        max_tokens=defaults.max_tokens if req.max_tokens is None else req.max_tokens,
        stop=list(req.stop), presence_penalty=presence, frequency_penalty=frequency,
        logprobs=req.logprobs, logit_bias=dict(req.logit_bias))
    return CheckedSampling(params, max_tokens_explicit=req.max_tokens is not None)
