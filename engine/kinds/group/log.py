"""The follower command log of a sharded engine: rank 0 decides, every rank executes.

Rank 0's runner drives its mlx-lm `BatchGenerator` through a `LeaderGenerator`, which sends
each call that changes the batch or runs the model (a new generator, insert, remove,
extract_cache, next, close; and the start-up probes, `ProbeModel`) to the followers before it
makes it. A `Follower` makes the same calls in the same order on its own generator over its
shard of the model, so the collectives inside the model meet: every rank runs the same steps
in lockstep. Samplers are rebuilt on each follower from the request's sampling parameters
(seeded per position, `engine/admit/sampling.py`), and the logits every rank samples from are
the same (the all-reduce gives every rank the same sums), so every rank picks the same token.

KV reuse: when rank 0 starts a row from cached KV (its RAM prefix cache, or a prefill group's
prompt), the command names the cached tokens; the follower takes its own shard of that KV from
`KvStore`, which keeps every cache its generator handed back (they are handed back at the same
calls on every rank). A follower that cannot find it has fallen out of step: it stops, and the
group restarts (`Desync`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec

from mlxd.protocol.messages import SamplingParams


class Row(msgspec.Struct, array_like=True, frozen=True):
    prompt: list[int]  # the tokens this row feeds
    prefix: list[int]  # the tokens whose KV it starts from ([]: none)
    max_tokens: int
    sampling: SamplingParams | None  # None: greedy, no processors
    resumed: int = 0  # tokens at the end of prefix + prompt that were already generated
    grammar: str | None = None


class GNew(msgspec.Struct, tag="new", array_like=True, frozen=True):
    completion_batch: int
    prefill_batch: int
    prefill_step: int
    eos: list[int]


class GInsert(msgspec.Struct, tag="ins", array_like=True, frozen=True):
    rows: list[Row]
    uids: list[int]  # what rank 0's generator returned: the follower's must match


class GRemove(msgspec.Struct, tag="rm", array_like=True, frozen=True):
    uids: list[int]
    caches: bool


class GExtract(msgspec.Struct, tag="ex", array_like=True, frozen=True):
    uids: list[int]


class GNext(msgspec.Struct, tag="next", array_like=True, frozen=True):
    pass


class GClose(msgspec.Struct, tag="close", array_like=True, frozen=True):
    pass


class GProbe(msgspec.Struct, tag="probe", array_like=True, frozen=True):
    tokens: list[list[int]]  # a forward pass outside the generator, on a fresh cache


class GStop(msgspec.Struct, tag="stop", array_like=True, frozen=True):
    pass


Command = GNew | GInsert | GRemove | GExtract | GNext | GClose | GProbe | GStop
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Command)


def encode(cmd: Command) -> bytes:
    return _encoder.encode(cmd)


def decode(data: bytes) -> Command:
    return _decoder.decode(data)


class Desync(RuntimeError):
    """A follower can no longer repeat rank 0's calls: the group must restart."""


class Notes:
    """Rank 0: what each admitted request's sampler and processors were built from, by request
    id, from admission until its row is inserted (or it is aborted first)."""

    def __init__(self) -> None:
        self._by_rid: dict[str, tuple[SamplingParams, int, str | None]] = {}

    def __len__(self) -> int:
        return len(self._by_rid)

    def note(self, rid: str, sampling: SamplingParams, resumed: int,
             grammar: str | None) -> None:
        self._by_rid[rid] = (sampling, resumed, grammar)

    def take(self, rid: str) -> tuple[SamplingParams | None, int, str | None]:
        return self._by_rid.pop(rid, None) or (None, 0, None)



class LeaderGenerator:
    """Rank 0's BatchGenerator, with every call the followers must repeat sent first."""

    def __init__(self, gen: Any, send: Callable[[Command], None],
                 broken: Callable[[BaseException], None] | None = None) -> None:
        self._gen = gen
        self._send = send
        # A call that fails on rank 0 leaves the ranks out of step (a follower gone mid-step
        # shows here first, as a lost connection): `broken` takes the group down, so that it is
        # restarted and its requests resume, instead of failing them and stepping on alone.
        self._broken = broken
        # what the rows of the next insert were built from (rank 0's runner sets it, one
        # entry per row, just before it inserts)
        self.next_rows: list[tuple[SamplingParams | None, int, str | None]] = []

    def insert(self, prompts: list[list[int]], max_tokens: list[int] | None = None,
               caches: list[Any] | None = None, all_tokens: list[list[int]] | None = None,
               samplers: list[Any] | None = None, logits_processors: list[list] | None = None,
               stop_sequences: list[Any] | None = None) -> list[int]:
        rows = []
        for i, prompt in enumerate(prompts):
            prefix = list(all_tokens[i]) if all_tokens else []
            if caches and caches[i] is not None and caches[i] and prefix \
                    and getattr(caches[i][0], "offset", len(prefix)) != len(prefix):
                raise Desync("a cached prefix whose KV length is not its token count")
            sampling, resumed, grammar = self.next_rows[i] if i < len(self.next_rows) \
                else (None, 0, None)
            rows.append(Row(list(prompt), prefix if caches and caches[i] is not None else [],
                            max_tokens[i] if max_tokens else 0, sampling, resumed, grammar))
        self.next_rows = []
        uids = self._call(self._gen.insert, prompts, max_tokens=max_tokens, caches=caches,
                          all_tokens=all_tokens, samplers=samplers,
                          logits_processors=logits_processors, stop_sequences=stop_sequences)
        self._send(GInsert(rows, list(uids)))
        return uids

    def remove(self, uids: list[int], return_prompt_caches: bool = False) -> Any:
        self._send(GRemove(list(uids), return_prompt_caches))
        return self._call(self._gen.remove, uids, return_prompt_caches=return_prompt_caches)

    def extract_cache(self, uids: list[int]) -> Any:
        self._send(GExtract(list(uids)))
        return self._call(self._gen.extract_cache, uids)

    def next(self) -> Any:
        self._send(GNext())
        return self._call(self._gen.next)

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            if self._broken is not None:
                self._broken(e)
            raise

    def close(self) -> None:
        self._send(GClose())
        self._gen.close()

    def __getattr__(self, name: str) -> Any:  # read-only figures (stats, nbytes)
        return getattr(self._gen, name)


class ProbeModel:
    """Rank 0's model for forward passes outside the generator (the KV-size probe, the SSD
    tier's layout probe): each call is sent to the followers and evaluated at once, so that
    every rank meets the same collectives."""

    def __init__(self, model: Any, send: Callable[[Command], None]) -> None:
        self._model = model
        self._send = send

    def __call__(self, inputs: Any, cache: Any = None) -> Any:
        import mlx.core as mx
        self._send(GProbe(inputs.tolist()))
        out = self._model(inputs, cache=cache)
        mx.eval(out)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class KvStore:
    """A follower's KV caches by token sequence, byte-capped, least recently used first out."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[tuple[int, ...], tuple[list[tuple[Any, Any]], int]] = \
            OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, tokens: list[int], cache: list[Any]) -> None:
        if not tokens or not cache or any(getattr(c, "keys", None) is None for c in cache):
            return
        n = min(len(tokens), cache[0].offset)
        key = tuple(tokens[:n])
        if n == 0 or key in self._entries:
            if key in self._entries:
                self._entries.move_to_end(key)
            return
        layers = [(c.keys[..., :n, :], c.values[..., :n, :]) for c in cache]
        size = sum(k.nbytes + v.nbytes for k, v in layers)
        self._entries[key] = (layers, size)
        self.bytes += size
        while self.bytes > self.max_bytes and len(self._entries) > 1:
            _, (_, old) = self._entries.popitem(last=False)
            self.bytes -= old

    def find(self, prefix: list[int]) -> list[tuple[Any, Any]] | None:
        """Layers holding at least `prefix`'s KV, from an entry that starts with it."""
        n = len(prefix)
        want = tuple(prefix)
        for key in reversed(self._entries):
            if len(key) >= n and key[:n] == want:
                self._entries.move_to_end(key)
                return self._entries[key][0]
        return None


class Follower:
    """A follower rank's side of the log: the same generator calls over its shard."""

    def __init__(self, model: Any, store_bytes: int, grammar_tokenizer: Any = None,
                 stream: Any = None) -> None:
        self.model = model
        self.store = KvStore(store_bytes)
        self.gen: Any = None
        self.eos: list[int] = []
        self.steps = 0
        self._grammar_tokenizer = grammar_tokenizer
        self._stream = stream

    def apply(self, cmd: Command) -> bool:
        """Make the call `cmd` names; False on GStop."""
        match cmd:
            case GNew():
                self._new(cmd)
            case GInsert():
                self._insert(cmd)
            case GRemove(uids=uids, caches=caches):
                for cache, tokens in self._need_gen().remove(
                        uids, return_prompt_caches=caches).values():
                    self.store.add(list(tokens), cache)
            case GExtract(uids=uids):
                for cache, tokens in self._need_gen().extract_cache(uids).values():
                    self.store.add(list(tokens), cache)
            case GNext():
                _, responses = self._need_gen().next()
                self.steps += 1
                for r in responses:
                    if r.finish_reason is not None and r.prompt_cache is not None:
                        self.store.add(list(r.all_tokens), r.prompt_cache)
            case GClose():  # as on rank 0, a closed generator is not dropped
                if self.gen is not None:
                    self.gen.close()
            case GProbe(tokens=tokens):
                import mlx.core as mx
                from mlx_lm.models.cache import make_prompt_cache
                mx.eval(self.model(mx.array(tokens), cache=make_prompt_cache(self.model)))
            case GStop():
                return False
        return True

    def _need_gen(self) -> Any:
        if self.gen is None:
            raise Desync("a generator call before the generator was made")
        return self.gen

    def _new(self, cmd: GNew) -> None:
        from mlx_lm.generate import BatchGenerator, StopSequences

        from mlxd.engine.mlx_lm_internals import unpadded_batch_masks
        unpadded_batch_masks()  # as the leader's runner does
        if self.gen is not None:
            self.gen.close()
        self.eos = list(cmd.eos)
        self._stops = StopSequences([[e] for e in cmd.eos])
        self.gen = BatchGenerator(self.model, completion_batch_size=cmd.completion_batch,
                                  prefill_batch_size=cmd.prefill_batch,
                                  prefill_step_size=cmd.prefill_step, stream=self._stream)

    def _insert(self, cmd: GInsert) -> None:
        from mlx_lm.models.cache import KVCache
        from mlx_lm.sample_utils import greedy_sampler

        from mlxd.engine.admit.sampling import make_request_processors, make_request_sampler
        gen = self._need_gen()
        caches: list[Any] = []
        samplers: list[Any] = []
        processors: list[list] = []
        for row in cmd.rows:
            if row.prefix:
                layers = self.store.find(row.prefix)
                if layers is None:
                    raise Desync(f"no KV here for a cached prefix of {len(row.prefix)} tokens")
                lent = []
                for k, v in layers:
                    c = KVCache()
                    c.keys, c.values, c.offset = k, v, len(row.prefix)
                    lent.append(c)
                caches.append(lent)
            else:
                caches.append(None)
            if row.sampling is None:
                samplers.append(greedy_sampler)
                processors.append([])
                continue
            samplers.append(make_request_sampler(row.sampling, start_position=row.resumed))
            procs = make_request_processors(row.sampling)
            if row.grammar is not None:
                from mlxd.engine.grammar.processor import GrammarProcessor
                whole = row.prefix + row.prompt
                replay = whole[len(whole) - row.resumed:] if row.resumed else []
                procs.append(GrammarProcessor(self._grammar_tokenizer, row.grammar,
                                              replay=replay, max_tokens=row.max_tokens))
            processors.append(procs)
        uids = gen.insert(
            [r.prompt for r in cmd.rows], max_tokens=[r.max_tokens for r in cmd.rows],
            caches=caches if any(c is not None for c in caches) else None,
            all_tokens=[r.prefix for r in cmd.rows] if any(r.prefix for r in cmd.rows)
            else None,
            samplers=samplers, logits_processors=processors,
            stop_sequences=[self._stops] * len(cmd.rows))
        if list(uids) != cmd.uids:
            raise Desync(f"row ids {list(uids)} here, {cmd.uids} on rank 0")
