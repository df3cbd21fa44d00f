"""The constrained rows of one generation step, masked together, with the device kept busy.

mlx-lm's step k builds the forward pass on the tokens sampled at step k-1 (still being computed
on the device), calls the logits processors, samples, starts the evaluation (`async_eval`) and
only then reads back the tokens of step k-1. A grammar row needs its token k-1 to compute its
mask for step k, so a processor that simply reads it leaves the device idle from the end of
step k-1 until the whole step k is submitted, and pays one synchronisation, one mask and one
host-side unpack per row.

The runner's hook (`GrammarSteps.step`, around `BatchGenerator.next`) finds the constrained
rows of the running batch and the lazy array of their previous tokens. Once the forward pass
of step k is built (as lazy ops), the first of those rows whose processor is called
(`StepPlan.allowed`):

1. reads the previous tokens of all rows at once (one wait, for step k-1 only);
2. has llguidance consume them (a few µs a row);
3. has every row's bitmask filled on llguidance's threads (parallel across rows, the GIL
   released; the costly part) while this thread dispatches the forward pass of step k
   (`mx.async_eval` of the logits: on a GPU, milliseconds of host work with the GIL released)
   and the device starts running it;
4. turns the bitmasks into one boolean array for every row (unpacked on a GPU, where only
   the packed bits travel; by numpy on the CPU backend); each row's processor then applies
   its own row of it where the step samples.

The other order (the hidden setting `grammar_order`, `MLXD_GRAMMAR_ORDER=dispatch-first`, for
comparisons) dispatches the forward pass first and fills the masks after it, one after the other
on the host, which on a GPU at a large batch costs constrained rows much more of their rate
against free ones (`benchmarks/constrained.py --before-env`; figures: benchmarks/HISTORY.md
section 21; the cost at the default: benchmarks/RESULTS.md, "Constrained decoding vs free").
On a device-bound step the wait of 1. comes before the dispatch, but the device then waits only
for the consumption of 2., not for the host's dispatch.

When every processor of the batch is one of these grammars (the usual case: constrained rows
beside free ones), mlx-lm's per-row processor loop is skipped as well: the forward pass's logits
are masked for the whole batch in one op (`WholeBatchMask`; free rows' mask rows allow all).

The tokens and masks are exactly those of the per-row path, so greedy and seeded outputs do not
change. Free rows of the batch wait for no more than on the per-row path (less: one wait
instead of one per constrained row). Rows the hook did not see (a row's first step, processors
wrapped by another, a generator whose internals differ) take the per-row path in
`processor.py`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, cast

import mlx.core as mx

from mlxd.engine.grammar.budget import apply
from mlxd.engine.grammar.processor import GrammarProcessor, apply_mask, unpack_bits
from mlxd.engine.mlx_lm_internals import RunningBatch, running_batch

_executor: Any = None
_executor_lock = threading.Lock()
_filler: ThreadPoolExecutor | None = None


def executor() -> Any:
    """llguidance's thread pool, one per process."""
    global _executor
    with _executor_lock:
        if _executor is None:
            import llguidance
            _executor = llguidance.LLExecutor()
        return _executor


def filler() -> ThreadPoolExecutor:
    """The thread that asks llguidance for a step's masks while the MLX thread dispatches."""
    global _filler
    with _executor_lock:
        if _filler is None:
            _filler = ThreadPoolExecutor(1, thread_name_prefix="engine-grammar")
        return _filler


def _fill(fill: list[tuple[Any, int]], bits: Any) -> None:
    from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par
    if len(fill) == 1:
        fill_next_token_bitmask(fill[0][0], bits, fill[0][1])
    elif fill:  # every row at once on llguidance's threads, the GIL released
        fill_next_token_bitmask_par(executor(), fill, bits)


class StepPlan:
    """One step's constrained rows: (row in the batch, processor, position of the token it
    consumes), and the lazy array of the tokens sampled at the previous step."""

    def __init__(self, rows: list[tuple[int, GrammarProcessor, int]], tokens: mx.array,
                 fill_first: bool = True) -> None:
        """`fill_first` (the default): the masks fill on llguidance's threads while this
        thread dispatches the forward pass; else (`grammar_order` dispatch-first, for
        comparisons) the dispatch comes first and the fill after it."""
        self.rows = rows
        self.fill_first = fill_first
        self._tokens = tokens
        self._index = {id(p): j for j, (_, p, _) in enumerate(rows)}
        self._allowed: mx.array | None = None
        self._ok: list[bool] = []
        self._whole = 0  # WholeBatchMask: the mask has a row per batch row (free ones: all)

    def allowed(self, proc: GrammarProcessor, logits: mx.array) -> mx.array | None:
        """`proc`'s row of the step's mask (None: its grammar failed, leave it free)."""
        if not self._ok:
            self._compute(logits)
        j = self._index[id(proc)]
        if not self._ok[j]:
            return None
        assert self._allowed is not None
        return self._allowed[j:j + 1]

    def _compute(self, logits: mx.array) -> None:
        from llguidance.numpy import allocate_token_bitmask
        if not self.fill_first:
            mx.async_eval(logits)  # 1. the forward pass of this step starts now
        previous = cast(list[int], self._tokens.tolist())  # 2. one wait, for the last step
        for i, p, position in self.rows:  # a few µs each: cheaper here than on the executor
            p.feed.consume(position, previous[i])  # once per position, in order
        self._ok = [not p.check_error() for _, p, _ in self.rows]
        vocab = logits.shape[-1]
        # all bits set: a row left unfilled (free, or its grammar failed) allows everything
        bits = allocate_token_bitmask(self._whole or len(self.rows), vocab)
        # a budget's word per row (`budget.py`): a forced token needs no fill
        words = [p.decision() if ok else None for (_, p, _), ok in zip(self.rows, self._ok,
                                                                       strict=True)]
        fill = [(p.matcher, i if self._whole else j)
                for j, ((i, p, _), word) in enumerate(zip(self.rows, words, strict=True))
                if self._ok[j] and (word is None or word.force is None)]
        if self.fill_first:  # 3. the masks fill while this thread dispatches the forward pass
            pending = filler().submit(_fill, fill, bits) if fill else None
            mx.async_eval(logits)
            if pending is not None:
                pending.result()
        else:  # 3. every row at once on llguidance's threads, the GIL released
            _fill(fill, bits)
        for j, (i, p, _) in enumerate(self.rows):
            word = words[j]
            if word is not None and p.budget is not None:
                apply(word, bits, i if self._whole else j, p.budget.vocab)
        self._allowed = unpack_bits(bits, vocab)  # 4. one array for every row


class GrammarSteps:
    """The runner's step hook: `with steps.step(gen): gen.next()`."""

    def __init__(self, fill_first: bool = True) -> None:
        self.fill_first = fill_first

    @contextmanager
    def step(self, gen: Any) -> Iterator[None]:
        batch = running_batch(gen)
        plan = plan_for(batch, self.fill_first) if batch is not None else None
        masked = None
        if plan is not None and batch is not None and covers(plan, batch.processors):
            masked = WholeBatchMask(plan, batch)
        try:
            yield
        finally:
            if masked is not None:
                masked.restore()
            if plan is not None:
                for _, p, _ in plan.rows:
                    p.plan = None  # a row not called this step (it should be) keeps no plan


class WholeBatchMask:
    """The step's forward pass masks its logits for the whole batch in one op, and mlx-lm's
    per-row processor loop is skipped: a slice, a context update and a mask per row, then a
    concatenation, graph ops that cost the host time per row and step on a GPU (figures:
    benchmarks/HISTORY.md section 15). Only
    for a batch whose processors are all the plan's grammars. The processors are taken away
    when the forward pass runs, not before: what decides before it (a lone row's speculation)
    still sees that the rows are constrained, and if it does not call the forward pass,
    nothing changes."""

    def __init__(self, plan: StepPlan, batch: RunningBatch) -> None:
        self.plan, self.batch = plan, batch
        self.model = batch.model
        self.taken: tuple[list[int], list[Any]] | None = None
        batch.model = self.forward

    def forward(self, inputs: mx.array, cache: Any = None) -> mx.array:
        b, plan = self.batch, self.plan
        logits = self.model(inputs, cache=cache)
        uids = b.uids
        self.taken = (uids, b.processors)
        b.processors = [[] for _ in uids]
        plan._whole = len(uids)
        plan._compute(logits[:, -1, :])
        for _, p, _ in plan.rows:
            p.skip_call()  # as if mlx-lm had called it: its positions stay in step
        assert plan._allowed is not None
        return apply_mask(logits, plan._allowed[:, None, :])

    def restore(self) -> None:
        b = self.batch
        b.model = self.model
        if self.taken is not None:  # rows may have finished (filtered) or joined (extended)
            mine = dict(zip(*self.taken, strict=True))
            now = b.processors
            b.processors = [mine.get(u, now[k]) for k, u in enumerate(b.uids)]


def covers(plan: StepPlan, processors: list) -> bool:
    """Every processor of the batch is one of the plan's grammars (one per row at most)."""
    planned = {id(p) for _, p, _ in plan.rows}
    return all(not ps or (len(ps) == 1 and id(ps[0]) in planned) for ps in processors) and \
        sum(1 for ps in processors if ps) == len(plan.rows)


def plan_for(batch: RunningBatch, fill_first: bool = True) -> StepPlan | None:
    """The constrained rows of the generator's running batch, each told of the plan; None
    when there are none or the batch is not shaped as expected (the per-row path then)."""
    processors = batch.processors
    if not processors or not any(processors):
        return None
    rows = [(i, p, p.calls - 1) for i, ps in enumerate(processors) for p in ps or ()
            if type(p) is GrammarProcessor and p.calls > 0]
    tokens = batch.pending
    if not rows or not isinstance(tokens, mx.array) or tokens.shape != (len(processors),):
        return None
    plan = StepPlan(rows, tokens, fill_first)
    for _, p, _ in rows:
        p.plan = plan
    return plan
