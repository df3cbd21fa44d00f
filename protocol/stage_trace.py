"""The per-token stage clock (opt-in, for benchmarks/stage_costs.py): every process on a
token's way from the MLX thread to the client stamps the token at each stage boundary, and
the stamps are joined afterwards into a cost per stage.

Switched on by the hidden setting `stage_trace` (`MLXD_STAGE_TRACE=DIR`), which every child
gets in its launch struct and hands to `configure` once at start; each process appends its
records, one JSON line per token, to `DIR/<role>-<pid>.jsonl` when a request finishes. Off,
nothing is installed: the hot path tests one module constant.

The clock is `time.perf_counter_ns()`: CLOCK_MONOTONIC on Linux, mach_absolute_time on macOS,
both one clock for every process of a host, so the engine's, the proxy's and a local client's
stamps compare directly and nothing travels on the wire. (A client on another machine could
only be compared through deltas.)

A token is named by its request id and its index (the request's completion tokens once it is
counted, as the `Delta` carries it); the proxy also records the characters delivered after
it, which is how a client, who sees chunks and not tokens, is joined.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import msgspec

DIR: str | None = None
ON: bool = False
now = time.perf_counter_ns


def configure(directory: str | None) -> None:
    """Switch the clock on for this process (at its start, from its launch struct)."""
    global DIR, ON
    DIR, ON = directory or None, bool(directory)

# Stage boundaries in the order a token passes them (see benchmarks/stage_costs.py).
ENGINE_STAGES = (
    "next_in",  # MLX thread: BatchGenerator.next called
    "graph_built",  # the step's graph built (mx.async_eval called for the next tokens)
    "dispatched",  # mx.async_eval returned
    "device_done",  # mx.eval of the current tokens returned: the device finished them
    "read_back",  # GenerationBatch._step returned (tokens read back as Python ints)
    "next_out",  # BatchGenerator.next returned (mlx-lm's stop matching, responses)
    "put",  # the runner put the step's tokens on the output queue
    "handed_off",  # ... which woke the output thread (engine/batch/handoff.py: deferred)
    "taken",  # output thread: began on the step
    "detokenized",  # this row's token detokenized, stop strings matched, delta built
    "encoded",  # the StepOutput msgpack-encoded
    "sent",  # ZeroMQ send returned
)
PROXY_STAGES = (
    "received",  # proxy: ZeroMQ recv returned
    "decoded",  # StepOutput decoded, deltas queued to their streams
    "handler",  # the request's handler task got the delta
    "chunk_built",  # the dialect's SSE bytes for it built
    "written",  # the SSE write returned (bytes handed to the transport)
)
CLIENT_STAGE = "client"  # the client parsed the chunk
STAGES = (*ENGINE_STAGES, *PROXY_STAGES, CLIENT_STAGE)
# A request's way to its first step, before it has a token: one record per request and
# process, `index` 0 (see `stamp_request`), for the burst table of benchmarks/burst.py.
REQUEST_STAGES = (
    "http_in",  # proxy: the request's headers read, its route begun (its body not yet read)
    "proxy_in",  # proxy: the request parsed and checked, its engine chosen next
    "sending",  # proxy: the Generate handed to ZeroMQ
    "engine_in",  # engine I/O thread: received, handed to an admission lane
    "lane",  # admission lane: its thread starts preparing it
    "tokenized",  # admission lane: templated and tokenized
    "restore_checked",  # admission lane: the RAM and SSD tiers asked what they hold of it
    "prepared",  # admission lane: templated, tokenized, checked, handed to the MLX thread
    "taken",  # MLX thread: taken from its inbox (an idle engine's burst gathering included)
    "inserted",  # MLX thread: inserted into the generator (prefilled at its next steps)
)


class TokenTrace(msgspec.Struct):
    """One token's stamps in one process (perf_counter_ns, per stage boundary)."""
    request_id: str
    index: int  # the request's completion tokens, this one counted
    stamps: dict[str, int]
    rows: int = 1  # engine: rows that produced a token in the same step
    chars: int = -1  # proxy: the request's characters delivered after this token


class TraceFile:
    """A process's trace records, appended to DIR/<role>-<pid>.jsonl on `flush`."""

    def __init__(self, role: str, directory: str | None = None) -> None:
        self.path = Path(directory or DIR or ".") / f"{role}-{os.getpid()}.jsonl"
        self._records: list[TokenTrace] = []
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._enc = msgspec.json.Encoder()

    def add(self, record: TokenTrace) -> None:
        with self._lock:  # `flush` may run on another thread
            self._records.append(record)

    def __len__(self) -> int:
        return len(self._records)

    def flush(self) -> None:
        with self._lock:  # held only to take the records: `add` never waits for the disk
            records, self._records = self._records, []
        if not records:
            return
        with self._write_lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "ab") as f:
                f.write(b"".join(self._enc.encode(r) + b"\n" for r in records))


_request_files: dict[str, TraceFile] = {}
_request_stamps: dict[str, dict[str, int]] = {}  # request id -> its stamps so far


def stamp_request(request_id: str, stage: str, role: str, last: bool = False,
                  at: int | None = None) -> None:
    """Stamp a request's `stage` (REQUEST_STAGES) in this process; the `last` stage of the
    process writes its record. Called only when ON; from any thread (one request's stages
    follow each other, so no two threads touch one request's stamps at once)."""
    stamps = _request_stamps.setdefault(request_id, {})
    stamps[stage] = at or now()
    if last:
        f = _request_files.get(role)
        if f is None:
            f = _request_files[role] = TraceFile(f"{role}-requests")
        f.add(TokenTrace(request_id, 0, _request_stamps.pop(request_id, stamps)))
        if len(f) >= FLUSH_AT:
            f.flush()


FLUSH_AT = 256  # request records kept before a write, where nothing calls `flush_requests`


def flush_requests() -> None:
    """Write the request records stamped so far. Called where a request's token records are
    written (its end), off the path the stamps measure: a file write per request on the MLX
    thread's insert loop or the proxy's event loop would be part of what a burst times."""
    for f in list(_request_files.values()):
        f.flush()


def forget_request(request_id: str) -> None:
    """A request that will not reach its last stamp here (refused, cancelled)."""
    _request_stamps.pop(request_id, None)


def read(directory: str | Path, requests: bool = False) -> list[TokenTrace]:
    """Every token's records of every process under `directory` (`requests`: the requests'
    records before their first token instead)."""
    dec = msgspec.json.Decoder(TokenTrace)
    records = [dec.decode(line) for p in sorted(Path(directory).glob("*.jsonl"))
               for line in p.read_bytes().splitlines() if line]
    return [r for r in records if (r.index == 0) == requests]
