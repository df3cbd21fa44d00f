"""Speculative decoding, the pure part: prompt-lookup drafting, the accept rule, and the
decision whether a step should draft at all. No MLX here; `step.py` is the glue.

The accept rule keeps the output exactly that of plain decoding: the target samples every
verified position with the sampler it would have used anyway (greedy, or the seeded key of
that position), and a drafted token is accepted while it equals what the target sampled. The
draft only decides how many tokens one target forward pass yields, never which ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NGRAM_MAX = 4  # the longest suffix looked up in the context
NGRAM_MIN = 2  # the shortest (single tokens match too often to be worth a draft)


class NgramIndex:
    """Prompt-lookup drafting: the tokens that followed the latest earlier occurrence of the
    context's last n tokens (n = NGRAM_MAX down to NGRAM_MIN). Built incrementally: each new
    token costs a few dict updates, a proposal a few dict lookups."""

    def __init__(self, max_n: int = NGRAM_MAX, min_n: int = NGRAM_MIN) -> None:
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        # n -> {n-gram: the position right after its latest occurrence}
        self._after: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_n, max_n + 1)}

    def extend(self, new: list[int]) -> None:
        toks = self.tokens
        for t in new:
            i = len(toks)
            for n, table in self._after.items():
                if i >= n:
                    table[tuple(toks[i - n:i])] = i  # toks[i] (t) continues this n-gram
            toks.append(t)

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens to try after the current context (empty: no match)."""
        toks, size = self.tokens, len(self.tokens)
        for n in range(self.max_n, self.min_n - 1, -1):
            if size < n:
                continue
            at = self._after[n].get(tuple(toks[size - n:]))
            if at is not None:
                return toks[at:at + k]
        return []


def accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many drafted tokens the target confirms: `sampled[i]` is what the target sampled
    after the context and drafts[:i]; a draft stands while it equals that."""
    n = 0
    while n < len(drafts) and sampled[n] == drafts[n]:
        n += 1
    return n


@dataclass
class SpecCounters:
    """Figures for /stats and /metrics (plain integers: read from another thread)."""
    steps: int = 0  # speculative steps (one target forward over the drafts)
    drafted: int = 0  # tokens proposed
    accepted: int = 0  # of those, confirmed by the target
    tokens: int = 0  # tokens those steps produced (accepted + one the target adds per step)
    skipped: int = 0  # lone-row steps run plain because drafting did not pay lately
    missed: int = 0  # lone-row steps that waited for their unfed token and found no draft
    batched: int = 0  # of `steps`, those that verified several rows at once


EMA = 0.3  # weight of a new timing in the running means
BACKOFF_MIN = 8  # plain steps before drafting is tried again, after it did not pay
BACKOFF_MAX = 256
# A step that could not have paid whatever was accepted pauses at least BACKOFF_MAX steps, and
# twice as long each time it happens again, up to this: on a CPU with reference BLAS every
# probe is one. On CUDA a verify pass through cuDNN would also pay for a graph build at its
# new key length, which is why engines run such short passes unfused
# (engine/load/cuda_attention.py; figures: benchmarks/RESULTS.md, "cuDNN attention on CUDA",
# and benchmarks/HISTORY.md section 21).
NEVER_PAYS_MAX = 4096


@dataclass
class SpecPolicy:
    """When a lone row's step drafts, and how many tokens.

    It measures rather than guesses: the mean time per produced token of plain steps and of
    speculative steps, both only ever for one row alone. While speculative steps cost more per
    token than plain ones (drafts rarely accepted), drafting pauses for a number of plain steps
    that doubles each time it still does not pay, up to BACKOFF_MAX, and is then tried again.
    A step that would not have paid even with every draft accepted (its forward pass costs
    about as much per token as one-token steps, as matmuls do on a CPU with reference BLAS)
    pauses drafting for BACKOFF_MAX steps at once, and each such step in a row twice as long,
    up to NEVER_PAYS_MAX; a step that pays starts the pauses short again."""
    max_draft: int
    adaptive: bool = False  # drafts cost a forward pass each (a draft model): fit the length
    judge: bool = True  # pause drafting while it does not pay (False: always draft)
    plain_s: float | None = None  # s per token, plain lone-row steps
    spec_s: float | None = None  # s per token, speculative steps
    accept_len: float | None = None  # mean accepted drafts per speculative step
    pause: int = 0  # plain steps left before drafting again
    backoff: int = BACKOFF_MIN
    counters: SpecCounters = field(default_factory=SpecCounters)

    def draft_len(self, remaining: int) -> int:
        """Tokens to draft for a lone row that may still produce `remaining` (0: plain)."""
        if self.max_draft <= 0 or remaining < 2 or self.pause > 0 \
                or (self.judge and self.plain_s is None):  # plain steps are timed first
            return 0
        k = self.max_draft
        if self.adaptive and self.accept_len is not None:
            k = min(k, max(1, int(self.accept_len + 1.5)))
        return min(k, remaining - 1)

    def record_plain(self, seconds: float | None) -> None:
        """A plain step of one row alone; `seconds` None when its time is not comparable
        (another step's work blurs it: the first after a speculative or a batched one)."""
        if self.pause > 0:
            self.pause -= 1
            self.counters.skipped += 1
        if seconds is not None:
            self.plain_s = _ema(self.plain_s, seconds)

    def record_miss(self) -> None:
        """A lone row's step waited for its unfed token to look up drafts and found none: the
        wait cost the step its overlap with the device (a plain step builds the next graph
        while the device still runs the current one) and yielded nothing. It pauses drafting
        as a speculative step that did not pay does, so misses cannot come every step."""
        self.counters.missed += 1
        if self.judge:
            self.pause = self.backoff
            self.backoff = _longer(self.backoff)

    def record_spec(self, seconds: float, drafted: int, accepted: int, produced: int,
                    rows: int = 1) -> None:
        """A speculative step over `rows` rows (their plain steps' time per row-token is
        `plain_s`)."""
        c = self.counters
        c.steps += 1
        c.batched += rows > 1
        c.drafted += drafted
        c.accepted += accepted
        c.tokens += produced
        self.accept_len = _ema(self.accept_len, accepted / rows)
        self.spec_s = _ema(self.spec_s, seconds / max(1, produced))
        if not self.judge or self.plain_s is None:
            return
        if (drafted + rows) * self.plain_s < seconds:
            # even had every draft been accepted, this step cost more than plain steps for
            # as many tokens: the forward pass costs as much per token however many it takes
            # (a CPU's matmul), and no acceptance rate can make drafting pay
            self.pause = self.backoff = min(max(self.backoff * 2, BACKOFF_MAX), NEVER_PAYS_MAX)
            self.spec_s = None
        elif self.spec_s > self.plain_s:
            self.pause = self.backoff
            self.backoff = _longer(self.backoff)
            self.spec_s = None  # judged afresh after the pause
        elif self.plain_s is not None:
            self.backoff = BACKOFF_MIN


def _longer(backoff: int) -> int:
    """The next pause after one that did not pay: twice as long up to BACKOFF_MAX, and never
    shorter than a pause a step that could never pay already earned."""
    return max(backoff, min(backoff * 2, BACKOFF_MAX))


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + EMA * (new - old)
