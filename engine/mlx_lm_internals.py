"""The one door to mlx-lm's internals.

mlx-lm's public API (`load`, `BatchGenerator`'s insert / next / remove / extract_cache, the
cache classes, the samplers) is used wherever the engine needs it. What mlx-lm does not
expose, mlxd reads or patches here and nowhere else, so that an mlx-lm upgrade breaks one
module, loudly, instead of five, silently:

- the rows a `BatchGenerator` is decoding (its `GenerationBatch`: the tokens sampled but not
  yet fed, token counts, stop matchers, logits processors, the model it calls), read and
  advanced as its own steps would (`RunningBatch`): speculative steps, grammar masks; prompts
  with only their last token left moved to generation as its next step would begin by doing,
  and new rows' first tokens read back in the step that samples them (`start_ended_prompts`,
  `sampled_tokens`: the early first token); a prompt's last token fed in its final chunk's
  pass and the row started from that pass's logits (`folding`, `start_folded`; the policy:
  `last_token_fold.py`);
- hooks around the generator's forward passes (`hook_forward_passes`: LoRA rows;
  `hook_row_tokens`: rows' token lists, for a vision model's positions), its device waits
  (`on_device_wait`: the step hand-off) and its step boundaries (`observe_steps`: the stage
  clock), made by wrapping two of its methods and giving `mlx_lm.generate` an `mx`
  module whose `eval` / `async_eval` run the hooks first;
- private helpers: a config's model classes, a repo id's download, the cache base class, the
  Hugging Face tokenizer inside mlx-lm's wrapper.

Importing this module checks that the installed mlx-lm is one it was written for
(`TESTED_RANGE`); on another it raises `UnsupportedMlxLm`, whose message is one line.
"""

from __future__ import annotations

import importlib
import logging
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch
from mlx_lm.models.cache import TokenBuffer, _BaseCache, make_prompt_cache, trim_prompt_cache

from mlxd.engine import last_token_fold

log = logging.getLogger("mlxd.engine")
TESTED_RANGE = ("0.32.2", "0.33")  # [low, high): the versions this module was written for


class UnsupportedMlxLm(ImportError):
    """The installed mlx-lm is outside `TESTED_RANGE` (an ImportError: the engine cannot use
    its internals)."""


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def check_version(found: str | None = None) -> None:
    """Raise `UnsupportedMlxLm` unless `found` (default: the installed mlx-lm) is in
    `TESTED_RANGE`."""
    found = found if found is not None else str(getattr(mlx_lm, "__version__", "unknown"))
    low, high = TESTED_RANGE
    if not _version_tuple(low) <= _version_tuple(found) < _version_tuple(high):
        raise UnsupportedMlxLm(
            f"mlxd's engine was written for mlx-lm >= {low}, < {high} and this environment "
            f"has mlx-lm {found}: install a version in that range "
            f"(pip install 'mlx-lm>={low},<{high}')")


check_version()

BaseCache = _BaseCache  # the base of mlx-lm's cache classes (a new batched cache derives it)


def hf_tokenizer(wrapper: Any) -> Any:
    """The Hugging Face tokenizer inside mlx-lm's `TokenizerWrapper`."""
    return wrapper._tokenizer


def model_classes(config: dict) -> tuple[type, type]:
    """(Model, ModelArgs) for a model config, as `mlx_lm.load` picks them."""
    from mlx_lm.utils import _get_classes
    classes: tuple[type, type] = _get_classes(config)
    return classes


def download(repo: str) -> Path:
    """A Hugging Face repo id resolved to a local directory, as `mlx_lm.load` resolves it."""
    from mlx_lm.utils import _download
    return Path(_download(repo))


# ---------------------------------------------------------------------- the running rows


class RunningBatch:
    """The rows a `BatchGenerator` is decoding (mlx-lm 0.32's `GenerationBatch`), read and
    advanced as its own steps would. Valid until the generator's next call."""

    def __init__(self, gen: BatchGenerator, batch: Any) -> None:
        self.gen = gen
        self._b = batch

    def __len__(self) -> int:
        return len(self._b)

    @property
    def uids(self) -> list[int]:
        return list(self._b.uids)

    @property
    def processors(self) -> list[list[Any]]:
        """Each row's logits processors (set: the step uses the ones given)."""
        return list(self._b.logits_processors)

    @processors.setter
    def processors(self, value: list[list[Any]]) -> None:
        self._b.logits_processors = value

    @property
    def model(self) -> Any:
        """What the step's forward pass calls (set: a wrapper around it)."""
        return self._b.model

    @model.setter
    def model(self, value: Any) -> None:
        self._b.model = value

    @property
    def cache(self) -> list[Any]:
        return list(self._b.prompt_cache)

    @property
    def pending(self) -> Any:
        """The tokens the last step sampled and the next one feeds (an array of one per row),
        or None."""
        return getattr(self._b, "_next_tokens", None)

    def pending_logprobs(self, row: int) -> mx.array:
        return self._b._next_logprobs[row]

    def sampler(self, row: int) -> Callable[..., Any]:
        b = self._b
        return (b.samplers[row] if b.samplers else None) or b.fallback_sampler

    def history(self, row: int) -> list[int]:
        """The row's tokens so far (prompt and generated), the pending one excepted."""
        tokens: list[int] = self._b.tokens[row]
        return tokens

    def remaining(self, row: int) -> int:
        """Tokens the row may still generate."""
        b = self._b
        return int(b.max_tokens[row] - b._num_tokens[row])

    def advance_alone(self, tokens: list[int], logprobs: list[Any], drafted: int,
                      next_token: mx.array, next_logprobs: mx.array,
                      rewind: Callable[[int], None] | None = None) -> list[Any]:
        """The lone row produced `tokens` (its pending token and the accepted drafts) in one
        forward pass over `drafted` drafts: account them as that many plain steps would
        (token count, stop matcher, finish, the generator's counters), trim the row's cache
        back to them (or, for layers that cannot be trimmed, `rewind(kept)`: restored and
        fed the kept tokens again) and leave `next_token` to be fed next. mlx-lm's
        responses, in order."""
        gen, b = self.gen, self._b
        finish = None
        produced = 0
        for t in tokens:
            produced += 1
            b._num_tokens[0] += 1
            if b._num_tokens[0] >= b.max_tokens[0]:
                finish = "length"
            if b._matchers[0].advance(t):
                finish = "stop"
            if finish is not None:
                break
        tokens = tokens[:produced]
        if drafted + 1 > produced:
            if rewind is not None:
                rewind(produced)
            else:
                trim_prompt_cache(b.prompt_cache, drafted + 1 - produced)
        b.tokens[0].extend(tokens)
        gen._counters.generation_tokens += produced
        gen._counters.generation_steps += 1
        uid = b.uids[0]
        response = type(b).Response
        out = [response(uid, t, lp, None, None, None)
               for t, lp in zip(tokens[:-1], logprobs, strict=False)]
        if finish is not None:
            out.append(response(uid, tokens[-1], logprobs[produced - 1], finish,
                                b.extract_cache(0), b.tokens[0]))
            b.filter([])
        else:
            out.append(response(uid, tokens[-1], logprobs[produced - 1], None, None, None))
            b._next_tokens = next_token
            b._next_logprobs = [next_logprobs]
        return out


    def advance_rows(self, rows: list[tuple[list[int], list[Any], Any]], fed: int,
                     next_tokens: mx.array) -> list[Any]:
        """Every row was fed `fed` tokens in one forward pass (its pending token, its drafts,
        filler up to the longest row's drafts); row i produced `rows[i][0]` (its pending token
        and the drafts accepted) with the log-probabilities `rows[i][1]`, and `next_tokens[i]`
        (log-probabilities `rows[i][2]`) is fed next. Account them as that many plain steps
        would, row by row (token count, stop matcher, finish), and drop each row's positions
        past what it produced: the count all rows share is trimmed, the rest of each row is
        moved to its left padding by mlx-lm's own right-padding roll (`prepare` + `finalize`,
        as a prefill of prompts of different lengths ends). Plain KV layers only
        (`BatchKVCache`). mlx-lm's responses, in order; finished rows leave the batch."""
        gen, b = self.gen, self._b
        kept: list[list[int]] = []
        finishes: list[str | None] = []
        for i, (tokens, _, _) in enumerate(rows):
            finish = None
            produced = 0
            for t in tokens:
                produced += 1
                b._num_tokens[i] += 1
                if b._num_tokens[i] >= b.max_tokens[i]:
                    finish = "length"
                if b._matchers[i].advance(t):
                    finish = "stop"
                if finish is not None:
                    break
            kept.append(tokens[:produced])
            finishes.append(finish)
        cut_rows_back(b.prompt_cache, [fed - len(t) for t in kept])
        response = type(b).Response
        out: list[Any] = []
        keep: list[int] = []
        for i, (tokens, finish) in enumerate(zip(kept, finishes, strict=True)):
            b.tokens[i].extend(tokens)
            logprobs = rows[i][1]
            uid = b.uids[i]
            out += [response(uid, t, lp, None, None, None)
                    for t, lp in zip(tokens[:-1], logprobs, strict=False)]
            if finish is not None:
                out.append(response(uid, tokens[-1], logprobs[len(tokens) - 1], finish,
                                    b.extract_cache(i), b.tokens[i]))
            else:
                out.append(response(uid, tokens[-1], logprobs[len(tokens) - 1], None, None,
                                    None))
                keep.append(i)
        gen._counters.generation_tokens += sum(len(t) for t in kept)
        gen._counters.generation_steps += 1
        b._next_tokens = next_tokens
        b._next_logprobs = [r[2] for r in rows]
        if len(keep) < len(rows):
            b.filter(keep)
        return out


def cut_rows_back(cache: list[Any], drop: list[int]) -> None:
    """Row i of a batch's `BatchKVCache` layers loses its last `drop[i]` positions: the count
    all rows share is trimmed, the rest of each row moved into its left padding by mlx-lm's own
    right-padding roll (`prepare` + `finalize`, as a prefill of prompts of different lengths
    ends), so the rows stay aligned at the end."""
    shared = min(drop)
    extra = [d - shared for d in drop]
    for c in cache:
        if shared:
            c.trim(shared)
        if any(extra):
            c.prepare(right_padding=extra)
            c.finalize()


def running_batch(gen: Any) -> RunningBatch | None:
    """The generator's decoding rows, or None when it is not shaped as this module knows."""
    batch = getattr(gen, "_generation_batch", None)
    if batch is None or not hasattr(batch, "logits_processors"):
        return None
    return RunningBatch(gen, batch)


def start_ended_prompts(gen: Any) -> list[Any]:
    """Move the prompts that have only their last token left to feed (their final chunk ran in
    this step) to generation now, as mlx-lm's next step would begin by doing: their last
    tokens' pass is dispatched in this step, not after the next step's decode pass. Returns
    their prompt responses (ends of prompts), as `next()` would have. A generator of another
    shape (a sharded group's leader, whose followers replay its calls) is left as it is."""
    if not isinstance(gen, BatchGenerator) or len(gen._generation_batch) \
            >= gen.completion_batch_size:
        return []
    processing = gen._currently_processing
    split = [i for i, seq in enumerate(processing) if len(seq[0]) == 1 and len(seq[0][0]) == 1]
    if not split:
        return []
    moved = set(split)
    with mx.stream(gen._stream):
        last_inputs = [processing[i][0][0] for i in split]
        progress = [(processing[i][2],) * 2 for i in split]
        gen._currently_processing = [seq for i, seq in enumerate(processing) if i not in moved]
        batch = gen._prompt_batch.split(split).generate(last_inputs)
        gen._generation_batch.extend(batch)
    return [PromptProcessingBatch.Response(uid, p, True, True)
            for uid, p in zip(batch.uids, progress, strict=True)]


def sampled_tokens(gen: Any, uids: list[int]) -> dict[int, int]:
    """The tokens the generator has sampled for rows `uids` and feeds in its next step, read
    back now (waiting for them). A new row's first token is one: mlx-lm samples it as the
    prompt's last token is fed (the `GenerationBatch`'s construction) and its `next()` returns
    it only a step later, after that step's forward pass is dispatched and any prompt chunk
    beside it has run."""
    batch = gen._generation_batch
    pending = getattr(batch, "_next_tokens", None)
    if pending is None or not uids:
        return {}
    at = {uid: i for i, uid in enumerate(batch.uids)}
    rows = [at[uid] for uid in uids if uid in at]
    if not rows:
        return {}
    values = pending.tolist()
    return {batch.uids[i]: int(values[i]) for i in rows}


def decoding_rows(gen: Any) -> int:
    """How many rows the generator decodes (prompts being prefilled not counted)."""
    return len(gen._generation_batch)


def prompts_waiting(gen: Any) -> int:
    """Prompts being prefilled or waiting to be (the next step takes up to its batch size)."""
    return min(len(gen._prompt_batch) + len(gen._unprocessed_sequences), gen.prefill_batch_size)


def decoding_only(gen: Any) -> bool:
    """Rows decoding, and no prompt waiting or being prefilled."""
    return (len(gen._generation_batch) > 0 and len(gen._prompt_batch) == 0
            and not gen._unprocessed_sequences)


def decoding_alone(gen: Any) -> bool:
    """One row decoding, and no prompt waiting or being prefilled."""
    return (len(gen._generation_batch) == 1 and len(gen._prompt_batch) == 0
            and not gen._unprocessed_sequences)


def _copy(x: Any) -> Any:
    # a new array object: in-place operators (`+=`) on the cache's then rebind only its own
    return None if x is None else x + 0


def save_states(cache: list[Any]) -> list[Any]:
    """What a batch's sliding-window and recurrent layers hold now (None for other layers),
    for `restore_states`: their arrays by reference (a forward pass of several tokens builds
    new ones rather than writing these), their small counters copied."""
    from mlx_lm.models.cache import ArraysCache, BatchRotatingKVCache
    saved: list[Any] = []
    for c in cache:
        if type(c) is BatchRotatingKVCache:
            saved.append((c.keys, c.values, _copy(c.offset), _copy(c.left_padding),
                          c.max_size, c._offset, c._idx, c.rotated, c._lengths))
        elif type(c) is ArraysCache:
            saved.append((list(c.cache), _copy(c.left_padding), _copy(c.lengths)))
        else:
            saved.append(None)
    return saved


def restore_states(cache: list[Any], saved: list[Any]) -> None:
    from mlx_lm.models.cache import ArraysCache, BatchRotatingKVCache
    for c, s in zip(cache, saved, strict=True):
        if type(c) is BatchRotatingKVCache:
            (c.keys, c.values, c.offset, c.left_padding, c.max_size, c._offset, c._idx,
             c.rotated, c._lengths) = s
        elif type(c) is ArraysCache:
            c.cache, c.left_padding, c.lengths = list(s[0]), s[1], s[2]


def prompt_contexts(gen: Any) -> tuple[list[int], list[int]]:
    """The context (cached and prompt tokens) of each prompt being prefilled, and of each one
    waiting to be, in the order the generator would take them."""
    batch = gen._prompt_batch
    prefilling = [len(t) + sum(len(s) for s in seq[0])
                  for t, seq in zip(batch.tokens, gen._currently_processing, strict=False)]
    # a waiting sequence: (uid, segments, max_tokens, cache, all_tokens, ...)
    waiting = [len(seq[4] or ()) + sum(len(s) for s in seq[1])
               for seq in gen._unprocessed_sequences]
    return prefilling, waiting


def reorder_waiting(gen: Any, order: list[int]) -> None:
    """The waiting prompts taken in `order` (indices into their present order) from now on."""
    if order != sorted(order):
        waiting = list(gen._unprocessed_sequences)
        gen._unprocessed_sequences.clear()
        gen._unprocessed_sequences.extend(waiting[i] for i in order)


def set_prefill_step(gen: Any, tokens: int) -> None:
    """Each prompt's share of a step's prefill, in one forward pass. mlx-lm's generator hands
    each prompt up to its `prefill_step_size` tokens a step, and its prompt batch runs them in
    passes of the batch's own `prefill_step_size`, taken once, when the generator made its
    empty prompt batch (`PromptProcessingBatch.empty`), and kept through every `extend`:
    setting the generator's alone, a 2,048-token step over a generator made with 512 ran four
    passes, each a new attention shape over the whole context (an unfused pass or a cuDNN
    graph build each on CUDA) with an eval and a cache release between them, where
    in-process mlx-lm runs one (issue 33)."""
    gen.prefill_step_size = tokens
    batch = getattr(gen, "_prompt_batch", None)
    if batch is not None:
        batch.prefill_step_size = tokens


def prefilled_tokens(gen: Any) -> int:
    """Prompt tokens the generator has prefilled so far (its own counter)."""
    return int(gen._counters.prompt_tokens)


# ---------------------------------------------------------------------- hooks


class ForwardRows(Protocol):
    """Told each row's first token before a batch's forward pass, cleared after it."""

    def set_rows(self, first_tokens: list[int]) -> None: ...

    def clear(self) -> None: ...


class ForwardRowTokens(Protocol):
    """Told, before a batch's forward passes, each row's token list (the list object mlx-lm
    keeps: by the passes, it holds every token the row's cache will hold after them) and
    where the row's fed tokens start in it; cleared after them."""

    def set_row_tokens(self, tokens: list[list[int]], starts: list[int]) -> None: ...

    def clear(self) -> None: ...


class StepObserver(Protocol):
    """Told of a generator step's boundaries (the stage clock)."""

    def next_started(self) -> None: ...

    def next_ended(self) -> None: ...

    def step_read_back(self) -> None: ...  # the decode step's tokens are read back

    def dispatching(self) -> None: ...  # inside the decode step: its graph is built

    def dispatched(self) -> None: ...

    def device_done(self) -> None: ...


_wait_hooks: list[Callable[[], None]] = []
_observer: StepObserver | None = None
_in_step = False
_shim: types.ModuleType | None = None
_rows_of: Callable[[Any], ForwardRows | None] | None = None
_row_tokens_of: Callable[[Any], ForwardRowTokens | None] | None = None
_wrapped_forward = False
_wrapped_next = False


def device_eval(*arrays: Any) -> None:
    """`mx.eval` after the device-wait hooks, for the engine's own steps (speculation)."""
    for hook in _wait_hooks:
        hook()
    mx.eval(*arrays)


def device_async_eval(*arrays: Any) -> None:
    for hook in _wait_hooks:
        hook()
    mx.async_eval(*arrays)


def _shim_async_eval(*arrays: Any) -> None:
    observer = _observer if _in_step else None
    if observer is not None:
        observer.dispatching()
    device_async_eval(*arrays)
    if observer is not None:
        observer.dispatched()


def _shim_eval(*arrays: Any) -> None:
    if _eval_with:  # a folded pass's logits, evaluated with its cache
        arrays = (*arrays, *_eval_with)
        _eval_with.clear()
    device_eval(*arrays)
    observer = _observer if _in_step else None
    if observer is not None:
        observer.device_done()


def _install_shim() -> None:
    """`mlx_lm.generate` gets an `mx` whose eval and async_eval run the hooks (once)."""
    global _shim
    if _shim is not None:
        return
    g: Any = importlib.import_module("mlx_lm.generate")  # (mlx_lm.generate is also a function)
    shim = types.ModuleType("mlx.core")
    shim.__dict__.update({k: v for k, v in vars(g.mx).items() if not k.startswith("__")})
    shim.__dict__.update(eval=_shim_eval, async_eval=_shim_async_eval)
    g.mx = _shim = shim


def on_device_wait(hook: Callable[[], None]) -> None:
    """Run `hook` before every `eval` / `async_eval` of mlx-lm's generator and of
    `device_eval` / `device_async_eval` (the moments the MLX thread lets go of the GIL)."""
    _install_shim()
    if hook not in _wait_hooks:
        _wait_hooks.append(hook)


def _install_step_wrap() -> None:
    global _wrapped_forward
    if _wrapped_forward:
        return
    prompt = _folding_prompt(PromptProcessingBatch.prompt)
    step = GenerationBatch._step

    def prompt_with_rows(self: Any, tokens: list[list[int]]) -> Any:
        rows = _rows_of(self.model) if _rows_of is not None else None
        listed = _row_tokens_of(self.model) if _row_tokens_of is not None else None
        if (rows is None and listed is None) or not tokens:
            return prompt(self, tokens)
        # mlx-lm adds the chunk to self.tokens (in place) before its forward passes; the
        # first token of a row is its first cached one or the first of this chunk
        if rows is not None:
            rows.set_rows([t[0] if t else (c[0] if c else -1)
                           for t, c in zip(self.tokens, tokens, strict=True)])
        if listed is not None:
            listed.set_row_tokens(self.tokens, [len(t) for t in self.tokens])
        try:
            return prompt(self, tokens)
        finally:
            if rows is not None:
                rows.clear()
            if listed is not None:
                listed.clear()

    def step_with_hooks(self: Any) -> Any:
        global _in_step
        rows = _rows_of(self.model) if _rows_of is not None else None
        listed = _row_tokens_of(self.model) if _row_tokens_of is not None else None
        if rows is not None:
            rows.set_rows(_first_tokens(self.tokens, self._next_tokens))
        if listed is not None:  # a row's list holds its cached tokens: the fed one is next
            listed.set_row_tokens(self.tokens, [len(t) for t in self.tokens])
        _in_step = True
        try:
            return step(self)
        finally:
            _in_step = False
            if rows is not None:
                rows.clear()
            if listed is not None:
                listed.clear()
            if _observer is not None:
                _observer.step_read_back()

    PromptProcessingBatch.prompt = prompt_with_rows  # type: ignore[method-assign]
    GenerationBatch._step = step_with_hooks  # type: ignore[method-assign]
    _wrapped_forward = True


def _first_tokens(tokens: list[list[int]], inputs: Any) -> list[int]:
    """Each row's first token: its first cached one, or (a one-token prompt going straight
    to decoding) the token it is about to feed."""
    out = [t[0] if t else -1 for t in tokens]
    if -1 in out and inputs is not None:
        fed = inputs.reshape(-1).tolist()
        out = [fed[i] if t < 0 else t for i, t in enumerate(out)]
    return out


def hook_forward_passes(rows_of: Callable[[Any], ForwardRows | None]) -> None:
    """Before every forward pass of a batch (a prompt chunk, a decode step), tell
    `rows_of(model)`, where it returns one, each row's first token, in the batch's row order
    (which mlx-lm keeps aligned through every insert, split, filter and extend). Passes made
    outside the generator (probes, embeddings) are not hooked."""
    global _rows_of
    _rows_of = rows_of
    _install_step_wrap()


def hook_row_tokens(row_tokens_of: Callable[[Any], ForwardRowTokens | None]) -> None:
    """Before every forward pass of a batch, tell `row_tokens_of(model)`, where it returns
    one, each row's token list and where its fed tokens start (a vision model whose positions
    follow its images: Qwen2-VL, Qwen2.5-VL). Passes made outside the generator are not
    hooked."""
    global _row_tokens_of
    _row_tokens_of = row_tokens_of
    _install_step_wrap()


def observe_steps(observer: StepObserver) -> None:
    """Tell `observer` of every generator call's start and end and of each decode step's
    graph build, dispatch, device completion and read-back."""
    global _observer, _wrapped_next
    _observer = observer
    _install_shim()
    _install_step_wrap()
    if _wrapped_next:
        return
    next_ = BatchGenerator.next

    def observed_next(self: Any) -> Any:
        if _observer is not None:
            _observer.next_started()
        try:
            return next_(self)
        finally:
            if _observer is not None:
                _observer.next_ended()

    BatchGenerator.next = observed_next  # type: ignore[method-assign]
    _wrapped_next = True


# ---------------------------------------------------------------------- the last token folded

# The fold's state (`last_token_fold.py` is its policy): the generator whose next step folds
# (set around its `next()` by `folding`), the runner's say per row, the vocabulary a pass
# showed (or the configuration's, until one), the folded rows' (last token, logits row) until
# `start_folded` in the same step, and arrays the next evaluation takes along (the shim).
_fold_gen: BatchGenerator | None = None
_may_fold: Callable[[int], bool] = lambda uid: False  # noqa: E731
_fold_vocab: dict[int, int] = {}  # id(model) -> its vocabulary (configured, then seen)
_fold_limit = 0
_folded: dict[int, tuple[int, mx.array]] = {}
_eval_with: list[mx.array] = []


def enable_fold(model: Any) -> None:
    """Prompt passes of `model` may fold their rows' last tokens in, where `folding` allows;
    its output head is probed now, before any pass of the generator's (`_Heads`)."""
    _install_shim()
    _install_step_wrap()
    _heads_of(model)


@contextmanager
def folding(gen: Any, may_fold: Callable[[int], bool], limit: int) -> Iterator[None]:
    """Around one `next()` of `gen` (and its speculation's): its prompt pass may fold the
    rows that `may_fold(uid)` allows whose final chunk is at most `limit` tokens
    (`last_token_fold.py`); the runner calls `start_folded` right after. A generator of
    another shape (a sharded group's leader, whose followers replay its calls) never folds."""
    global _fold_gen, _may_fold, _fold_limit
    if type(gen) is not BatchGenerator:
        yield
        return
    if id(gen.model) not in _fold_vocab:
        _fold_vocab[id(gen.model)] = last_token_fold.vocab_size(gen.model)
    _fold_gen, _may_fold, _fold_limit = gen, may_fold, limit
    _folded.clear()  # (what a step that failed after its pass left: never a later step's)
    try:
        yield
    finally:
        _fold_gen, _may_fold = None, lambda uid: False


def _folding_prompt(prompt: Callable[[Any, list[list[int]]], Any]
                    ) -> Callable[[Any, list[list[int]]], Any]:
    """mlx-lm's `PromptProcessingBatch.prompt`, folding where `folding` allows: the chosen
    rows' last tokens join their chunks, and the model's logits at their last positions are
    kept, evaluated with the chunk's cache."""

    def fold_or_prompt(self: Any, tokens: list[list[int]]) -> Any:
        gen = _fold_gen
        if gen is None or self is not gen._prompt_batch or not tokens:
            return prompt(self, tokens)
        processing = gen._currently_processing
        rows = last_token_fold.fold_rows(
            [len(t) for t in tokens], [seq[0] for seq in processing],
            [_may_fold(uid) and not self.logits_processors[i] for i, uid in enumerate(self.uids)],
            self.prefill_step_size,
            0 if _sliced(self.model) else _fold_vocab.get(id(self.model), 1 << 18),
            _fold_limit)
        if not rows:
            return prompt(self, tokens)
        lasts = []
        for i in rows:
            seq = processing[i]
            lasts.append(seq[0].pop()[0])  # its one segment left, [last]: none is left after
            tokens[i] = [*tokens[i], lasts[-1]]
            seq[1] += 1
        capture = _LastLogits(self.model, rows, [len(tokens[i]) - 1 for i in rows])
        self.model = capture
        try:
            out = prompt(self, tokens)
        finally:
            self.model = capture.model
            _eval_with.clear()
        for i, last, row_logits in zip(rows, lasts, capture.rows(), strict=True):
            _folded[self.uids[i]] = (last, row_logits)
        return out

    return fold_or_prompt


class _LastLogits:
    """The model for one folded prompt pass: keeps the logits at the folded rows' last
    positions, for the pass's evaluation to take along. Where the model's output head is known
    (`_Heads`), it is applied to those positions alone; otherwise the model computes every
    position's logits and they are sliced (which `last_token_fold.fold_rows` bounds)."""

    def __init__(self, model: Any, rows: list[int], positions: list[int]) -> None:
        self.model, self._rows, self._positions = model, rows, positions
        self._logits: mx.array | None = None

    def __call__(self, inputs: mx.array, *args: Any, **kwargs: Any) -> Any:
        if self._logits is not None:
            raise RuntimeError("a folded prompt chunk ran as more than one pass")
        rows, positions = mx.array(self._rows), mx.array(self._positions)
        heads = _heads_by_model.get(id(self.model))
        if heads is not None and heads.sliced:
            with heads.at(rows, positions):
                out = self.model(inputs, *args, **kwargs)
            self._logits = out[:, 0, :]
        else:
            out = self.model(inputs, *args, **kwargs)
            self._logits = out[rows, positions]
        _fold_vocab[id(self.model)] = int(out.shape[-1])
        _eval_with.append(self._logits)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def rows(self) -> list[mx.array]:
        assert self._logits is not None
        return [self._logits[k:k + 1] for k in range(len(self._rows))]


class _Heads:
    """A model's output head (its `lm_head` modules, or the embeddings whose `as_linear` ties
    the output to the input), applied for one pass to chosen (row, position) pairs only: the
    hidden states those rows hold at those positions, (rows, 1, hidden), so the pass's output is
    (rows, 1, vocabulary) and no other position's logits are computed. `sliced` only where a
    probe as the fold is enabled showed the sliced output equal to the whole one's positions
    (a model whose head is elsewhere, or which reshapes after it, keeps the whole output), and
    not where a head is a layer of another class: a LoRA adapter's (`kinds/text/lora.py`) adds
    each batch row's own delta, which needs every row."""

    def __init__(self, model: Any) -> None:
        named = model.named_modules() if isinstance(model, nn.Module) else []
        heads = [(name, m) for name, m in named if name.rsplit(".", 1)[-1] == "lm_head"]
        self._heads = [(self._owner(model, name), "lm_head") for name, _ in heads]
        self._tied = [m for _, m in named if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))]
        self._at: tuple[mx.array, mx.array] | None = None
        plain = all(type(m) in (nn.Linear, nn.QuantizedLinear) for _, m in heads)
        self.sliced = plain and bool(self._heads or self._tied) and self._probe(model)

    @staticmethod
    def _owner(model: Any, name: str) -> Any:
        owner = model
        for part in name.split(".")[:-1]:
            owner = owner[int(part)] if isinstance(owner, list) else getattr(owner, part)
        return owner

    def _pick(self, h: mx.array) -> mx.array:
        assert self._at is not None
        rows, positions = self._at
        return h[rows, positions][:, None, :]

    @contextmanager
    def at(self, rows: mx.array, positions: mx.array) -> Iterator[None]:
        self._at = (rows, positions)
        saved = [(owner, attr, getattr(owner, attr)) for owner, attr in self._heads]
        try:
            for owner, attr, head in saved:
                setattr(owner, attr, lambda h, head=head: head(self._pick(h)))
            for emb in self._tied:  # (an instance attribute shadows the class's method)
                emb.__dict__["as_linear"] = self._tied_head(emb)
            yield
        finally:
            for owner, attr, head in saved:
                setattr(owner, attr, head)
            for emb in self._tied:
                emb.__dict__.pop("as_linear", None)
            self._at = None

    def _tied_head(self, emb: Any) -> Callable[[mx.array], mx.array]:
        def head(h: mx.array) -> mx.array:
            return type(emb).as_linear(emb, self._pick(h))
        return head

    def _probe(self, model: Any) -> bool:
        """Two passes of a short prompt over fresh caches, whole and sliced at two positions:
        the same logits there, or the head is not used as this class assumes."""
        try:
            x = mx.array([[1, 2, 3, 4], [5, 6, 7, 8]])
            rows, positions = mx.array([0, 1]), mx.array([3, 2])
            whole = model(x, cache=make_prompt_cache(model))[rows, positions]
            with self.at(rows, positions):
                out = model(x, cache=make_prompt_cache(model))
            ok = out.shape[:2] == (2, 1) and bool(mx.allclose(
                out[:, 0, :].astype(mx.float32), whole.astype(mx.float32), atol=1e-2, rtol=1e-2))
        except Exception:  # a model this probe cannot run: slicing is simply not used
            log.warning("the output head is applied to every position of a folded pass",
                        exc_info=True)
            ok = False
        return ok


_heads_by_model: dict[int, _Heads] = {}


def _sliced(model: Any) -> bool:
    heads = _heads_by_model.get(id(model))
    return heads is not None and heads.sliced


def _heads_of(model: Any) -> _Heads:
    heads = _heads_by_model.get(id(model))
    if heads is None:
        heads = _heads_by_model[id(model)] = _Heads(model)
    return heads


def start_folded(gen: Any) -> list[Any]:
    """Move the rows whose last token was folded into this step's pass to generation, their
    first token sampled from that pass's logits as `GenerationBatch`'s first step would have
    sampled it. Returns their prompt responses (ends of prompts)."""
    if not _folded:
        return []
    folded = dict(_folded)
    _folded.clear()
    processing = gen._currently_processing
    uids = gen._prompt_batch.uids
    split = [i for i, seq in enumerate(processing) if not seq[0] and uids[i] in folded]
    progress = [(processing[i][2],) * 2 for i in split]
    with mx.stream(gen._stream):
        moved = set(split)
        gen._currently_processing = [seq for i, seq in enumerate(processing) if i not in moved]
        part = gen._prompt_batch.split(split)
        batch = _started(part, [folded[u] for u in part.uids])
        gen._generation_batch.extend(batch)
    return [PromptProcessingBatch.Response(uid, p, True, True)
            for uid, p in zip(batch.uids, progress, strict=True)]


def _started(part: Any, folded: list[tuple[int, mx.array]]) -> Any:
    """A `GenerationBatch` of `part`'s rows as its construction leaves one (its first step
    run: the last tokens fed, the first tokens sampled and dispatched), from the folded
    logits. Mirrors mlx-lm's `GenerationBatch.__init__` and `_step`."""
    n = len(part.uids)
    gb: Any = GenerationBatch.__new__(GenerationBatch)  # (its fields set here, as __init__'s)
    gb.model, gb.uids = part.model, part.uids
    gb.prompt_cache, gb.tokens = part.prompt_cache, part.tokens  # (the last tokens included)
    gb.samplers, gb.fallback_sampler = part.samplers, part.fallback_sampler
    gb.logits_processors, gb.stop_sequences = part.logits_processors, part.stop_sequences
    gb.max_tokens = part.max_tokens
    gb._token_context = [TokenBuffer(t) for t in part.tokens]
    gb._num_tokens = [0] * n
    gb._matchers = [ss.matcher() for ss in part.stop_sequences]
    gb._current_tokens = mx.array([last for last, _ in folded])
    gb._current_logprobs = []
    logits = mx.concatenate([row for _, row in folded], axis=0)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    samplers = [part.fallback_sampler if s is None else s
                for s in (part.samplers or [None] * n)]
    if not samplers or all(s is samplers[0] for s in samplers):
        sampled = (samplers[0] if samplers else part.fallback_sampler)(logprobs)
    else:
        sampled = mx.concatenate([s(logprobs[e:e + 1]) for e, s in enumerate(samplers)],
                                 axis=0)
    gb._next_tokens = sampled
    gb._next_logprobs = list(logprobs)
    mx.async_eval(gb._next_tokens, gb._next_logprobs)
    return gb


# ---------------------------------------------------------------------- masks of unpadded batches

_PADS = "_mlxd_pads"  # on a BatchKVCache: each row's left padding, or None/absent: unknown
_RIGHT = "_mlxd_right"  # the right padding `prepare` was given, until `finalize` moves it


def left_padding(cache: Any) -> list[int] | None:
    """Each row's left padding in a `BatchKVCache` (None for another cache), read from the
    host-side copy the patched methods keep, or once from the (small) array after a `state`
    assignment."""
    if not getattr(cache, "_mlxd_unpadded_masks", False):
        return None
    pads = cache.__dict__.get(_PADS)
    if pads is None:
        pads = cache.__dict__[_PADS] = [int(p) for p in cache.left_padding.tolist()]
    return list(pads)


def unpadded_batch_masks() -> None:
    """A `BatchKVCache` none of whose rows is padded asks for the mask a single sequence's
    `KVCache` asks for: none for one token, `"causal"` for several, instead of mlx-lm's array
    mask of all-true padding columns. An array mask keeps MLX's fused attention away (CUDA's
    vector kernel and cuDNN take no array mask for a decode step: every step at a long
    context ran the unfused fallback; `benchmarks/cuda_long_context.py`). Each row's padding
    is kept on the Python side where mlx-lm's own methods set it (`left_padding`), so no step
    waits on the device to find out. Installed once per process (not at all with the hidden
    setting `batch_masks` at `array`, the benchmarks' other side)."""
    from mlx_lm.models.cache import BatchKVCache
    if getattr(BatchKVCache, "_mlxd_unpadded_masks", False):
        return
    init, prepare, finalize = BatchKVCache.__init__, BatchKVCache.prepare, BatchKVCache.finalize
    filter_, extend, make_mask = BatchKVCache.filter, BatchKVCache.extend, BatchKVCache.make_mask
    state: Any = BatchKVCache.__dict__["state"]  # the property itself

    def known(cache: Any) -> list[int] | None:
        return cache.__dict__.get(_PADS)

    def __init__(self: Any, left_padding: list[int]) -> None:
        init(self, left_padding)
        self.__dict__[_PADS] = ([int(p) for p in left_padding]
                                if isinstance(left_padding, list | tuple) else None)

    def prepare_(self: Any, *, left_padding: Any = None, right_padding: Any = None,
                 **kwargs: Any) -> None:
        prepare(self, left_padding=left_padding, right_padding=right_padding, **kwargs)
        pads = known(self)
        if left_padding is not None:
            self.__dict__[_PADS] = (None if pads is None else
                                    [p + int(q) for p, q in zip(pads, left_padding, strict=True)])
        if self._right_padding is not None:
            self.__dict__[_RIGHT] = [int(q) for q in right_padding]

    def finalize_(self: Any) -> None:
        finalize(self)
        right, pads = self.__dict__.pop(_RIGHT, None), known(self)
        if right is not None:  # finalize moved it to the left
            self.__dict__[_PADS] = (None if pads is None else
                                    [p + q for p, q in zip(pads, right, strict=True)])

    def filter_rows(self: Any, batch_indices: Any) -> None:
        filter_(self, batch_indices)  # which shifts the padding common to the rows left, and
        # waits for the device to read it: reading the result adds no wait
        self.__dict__[_PADS] = [int(p) for p in self.left_padding.tolist()]

    def extend_(self: Any, other: Any) -> None:
        mine, theirs = known(self), known(other)
        top = max(self._idx, other._idx)  # the shorter side is padded on the left to it
        pads = (None if mine is None or theirs is None else
                [p + top - self._idx for p in mine] + [p + top - other._idx for p in theirs])
        extend(self, other)
        self.__dict__[_PADS] = pads

    def set_state(self: Any, v: Any) -> None:
        state.fset(self, v)
        self.__dict__[_PADS] = None

    def make_mask_(self: Any, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        if (not return_array and kwargs.get("window_size") is None
                and self._right_padding is None and not any(left_padding(self) or [1])):
            return None if N == 1 else "causal"
        return make_mask(self, N, return_array=return_array, **kwargs)

    BatchKVCache.__init__ = __init__  # type: ignore[method-assign]
    BatchKVCache.prepare = prepare_  # type: ignore[method-assign]
    BatchKVCache.finalize = finalize_  # type: ignore[method-assign]
    BatchKVCache.filter = filter_rows  # type: ignore[method-assign]
    BatchKVCache.extend = extend_  # type: ignore[method-assign]
    BatchKVCache.state = property(state.fget, set_state)  # type: ignore[method-assign,assignment]
    BatchKVCache.make_mask = make_mask_  # type: ignore[method-assign]
    BatchKVCache._mlxd_unpadded_masks = True  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- attention

def route_attention(attention: Callable[..., Any] | None) -> None:
    """mlx-lm's models attend through `models.base.scaled_dot_product_attention`, which calls
    `mx.fast.scaled_dot_product_attention` for an unquantized cache; send those calls to
    `attention` (same signature, and the layer's cache as `cache`) instead, in every model
    module imported so far (they bind the name at import: call this after loading).
    mlx-vlm's language models (a vision engine's) attend through mlx-vlm's own function of
    the same name and signature: routed alike where their cache is one of mlx-lm's plain
    caches (what a vision engine gives them), mlx-vlm's own otherwise (its quantized caches,
    a tower's attention without a cache). Installing again replaces the route; None gives the
    libraries' functions back."""
    import sys

    from mlx_lm.models import base
    _route_family(sys.modules, "mlx_lm.models", base, attention,
                  lambda cache: not hasattr(cache, "bits"))
    vlm_base = sys.modules.get("mlx_vlm.models.base")
    if vlm_base is not None:
        _route_family(sys.modules, "mlx_vlm.models", vlm_base, attention,
                      lambda cache: cache is not None and not hasattr(cache, "bits")
                      and type(cache).__module__.startswith("mlx_lm."))


def _route_family(modules: dict[str, Any], prefix: str, base: Any,
                  attention: Callable[..., Any] | None, routes: Callable[[Any], bool]) -> None:
    original = base.__dict__.setdefault("_mlxd_sdpa", base.scaled_dot_product_attention)
    previous = base.__dict__.get("_mlxd_routed")

    def sdpa(queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any,
             sinks: Any = None) -> Any:
        if not routes(cache):  # quantized attention and the like: the library's own
            return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        assert attention is not None
        return attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks, cache=cache)
    now = original if attention is None else sdpa
    base.__dict__["_mlxd_routed"] = now
    for name, module in list(modules.items()):
        if name.startswith(prefix) and getattr(
                module, "scaled_dot_product_attention", None) in (original, previous):
            setattr(module, "scaled_dot_product_attention", now)  # noqa: B010
