"""How long this engine's steps take now, told to the hang watchdog with every heartbeat. Pure
policy (the runner feeds it; `daemon/watchdog.py` reads the figure).

The watchdog calls a busy engine hung when its step counter has not moved for
`--hang-timeout`. The runner keeps a prefilling step near a quarter of that timeout
(`chunking.py`), but not below its smallest chunk: on slow hardware (this project's CPU runs
the default model at about 8 prompt tokens a second; a large model on a small Mac; a long
context) one chunk of 16 or 64 tokens can outlast a short timeout, and the watchdog would kill
a working engine over and over until the poison guard gives up on the request. So the engine
states its own pace: the longer of its last step and what the step now running should take
(its prompt tokens at the last seen seconds per prompt token; before any step of this
runner, the warm-up's figure). The watchdog waits a few times that pace before it calls the
engine hung (`watchdog.PACE_FACTOR`): a step that really hangs is still caught, as a share of
what a step costs on that machine, not of a timeout chosen for another.
"""

from __future__ import annotations


class StepPace:
    def __init__(self, token_s: float | None = None) -> None:
        """`token_s`: seconds per prompt token measured before this runner's first step (the
        warm-up's), or None."""
        self.token_s = token_s  # seconds per prompt token of the last step that prefilled
        self.last_s = 0.0  # the last step's duration

    def starting(self, prompt_tokens: int) -> float:
        """The pace to report while a step that prefills up to `prompt_tokens` runs."""
        expected = prompt_tokens * self.token_s if self.token_s and prompt_tokens > 0 else 0.0
        return max(self.last_s, expected)

    def ended(self, seconds: float, prefilled: int) -> None:
        """A step took `seconds` and prefilled `prefilled` prompt tokens (its decode work
        included: a per-token figure that errs long, as a watchdog's patience should)."""
        self.last_s = seconds
        if prefilled > 0 and seconds > 0:
            self.token_s = seconds / prefilled


class PassPace(StepPace):
    """The pace of forward passes over whole inputs (an embedding batch), which cannot be cut
    into chunks: a pass's cost per token grows with its inputs' length (attention), so the
    figure measured at one length is stretched for a longer one."""

    def __init__(self, width: int, token_s: float | None = None) -> None:
        """`width`: the model's hidden size; `token_s` as StepPace's, measured on inputs
        short enough to count as length 0."""
        super().__init__(token_s)
        self.width = max(1, width)
        self.seen = 0  # the longest input of the pass that measured `token_s`

    def starting_pass(self, padded_tokens: int, longest: int) -> float:
        """The pace to report while a pass of `padded_tokens` whose longest input has
        `longest` tokens runs."""
        if not self.token_s or padded_tokens <= 0:
            return self.last_s
        grown = attention_growth(longest, self.seen, self.width)
        return max(self.last_s, padded_tokens * self.token_s * grown)

    def token_s_at(self, longest: int) -> float | None:
        """Seconds a padded token should cost in a pass whose inputs reach `longest` tokens
        (None: no pass or warm-up timed yet)."""
        if not self.token_s:
            return None
        return self.token_s * attention_growth(longest, self.seen, self.width)

    def ended_pass(self, seconds: float, padded_tokens: int, longest: int) -> None:
        self.ended(seconds, padded_tokens)
        if padded_tokens > 0 and seconds > 0:
            self.seen = longest


def attention_growth(longest: int, seen: int, width: int) -> float:
    """How many times a token costs more in a pass whose inputs reach `longest` tokens than
    in one whose inputs reached `seen`. The weights cost the same per token at any length;
    attention grows with it. Counting attention as costing what the weights do once inputs
    reach `width` tokens (the hidden size; in a transformer's arithmetic it is several times
    that) makes the growth err long, as a watchdog's patience should."""
    return max(1.0, (1 + longest / width) / (1 + seen / width))
