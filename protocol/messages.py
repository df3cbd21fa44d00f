"""Every message that crosses a process boundary, as msgspec Structs.

One tagged union per channel direction; every member is `array_like=True` (msgspec refuses
mixed unions) and fields are only ever appended, with defaults. Messages that can outlive a
process carry the sender's epoch so that stale ones are dropped.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from mlxd.protocol.block_format import Layout
from mlxd.protocol.settings import PoolShare

Role = Literal["proxy", "engine", "storage"]
# A child process as the supervisor sees it (supervisord-style states).
ChildState = Literal["starting", "ready", "backoff", "failed", "stopping", "stopped"]
# An engine as it reports itself.
EngineState = Literal["loading", "ready", "failed", "stopping"]
# Why a request ended: its stop (an EOS or a stop string), its length limit, an abort (the
# client went, or the request was cancelled), an error (`error`, `error_code` say which).
FinishReason = Literal["stop", "length", "abort", "error"]
CacheSource = Literal["ram", "ssd", "none"]  # where a request's cached prefix came from
SsdState = Literal["off", "ok", "degraded"]


class _Msg(msgspec.Struct, array_like=True, tag=True, omit_defaults=False):
    pass


# ---------------------------------------------------------------- proxy -> engine (requests)

class SamplingParams(msgspec.Struct, array_like=True):
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    max_tokens: int = 512
    stop: list[str] = []
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int = -1  # -1: none; k >= 0: each token's log-probability and the k most likely
    logit_bias: dict[int, float] = {}  # token id -> added to its logit before sampling


class ImageInput(msgspec.Struct, array_like=True):
    """A decoded image (the proxy decodes; an engine never sees encoded bytes): RGB, 3 bytes a
    pixel, row by row, and `key`, the blake3 of its size and pixels (its content hash).
    `pixels` empty: an image the proxy sent this engine process recently, which its image
    table holds (`proxy/engines/sent_images.py`); an engine that does not hold it
    answers the request with error code `image_unknown`, and the proxy sends it whole."""
    width: int
    height: int
    pixels: bytes
    key: bytes


def image_key(width: int, height: int, pixels: bytes) -> bytes:
    """An image's content hash: blake3 of its size (two u32 LE) and its RGB pixels."""
    import blake3
    h = blake3.blake3(width.to_bytes(4, "little") + height.to_bytes(4, "little"))
    h.update(pixels)
    return h.digest()


class Generate(_Msg, tag="gen"):
    """Start a request. Exactly one of `messages` (chat) or `prompt` (completion) is used."""
    request_id: str
    sampling: SamplingParams
    messages: list[dict] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    add_generation_prompt: bool = True
    # Transparent resume: tokens (and characters of text) already delivered to the client by an
    # engine that died. They are appended to the prompt; sampling continues at their count.
    resume_token_ids: list[int] = []
    resume_text_len: int = 0
    # Only tokenize: the engine answers with the prompt's token count and finishes at once
    # (Anthropic's count_tokens); nothing is generated.
    count_only: bool = False
    # llguidance grammar (JSON) the output must follow: structured output, forced tool calls.
    grammar: str | None = None
    tools: list[dict] | None = None  # function tools, given to the chat template
    # Fill-in-the-middle: `prompt` is the text before the hole, this the text after it; the
    # model's FIM tokens frame them (a client error if it has none).
    suffix: str | None = None
    # n > 1 (OpenAI `n`): one Generate per answer, all naming one group of `group_size`; the
    # engine prefills the prompt once, for the first to arrive, and the others share its KV.
    prefill_group: str = ""
    group_size: int = 1
    # Completions' `echo` of a prompt given as token ids: the admission notice carries the
    # prompt's text (`Delta.prompt_text`).
    echo_prompt: bool = False
    # A LoRA adapter's name (`--adapter`) that this request's rows run with ("": the base).
    adapter: str = ""
    # Images (vision models): the messages' image parts in order, or with `prompt`, images
    # that come before the prompt's text.
    images: list[ImageInput] = []


class Abort(_Msg, tag="abort"):
    request_ids: list[str]  # ["*"]: every request on the engine


class FlushCache(_Msg, tag="flush"):
    """Make every cached entry durable on SSD; answered by CacheFlushed."""
    token: str
    timeout: float = 60.0


class Embed(_Msg, tag="embed"):
    """Embed each of `inputs` (texts), or of `input_token_ids`; answered by one `Embeddings`,
    or by an error `Delta` (a client error, such as an input longer than the model takes)."""
    request_id: str
    inputs: list[str] = []
    input_token_ids: list[list[int]] = []
    truncate: bool = False  # cut inputs longer than the model takes (else a client error)
    dimensions: int = 0  # keep each vector's first `dimensions` and renormalize (0: all)
    # Rerank: each of `inputs` is a document scored against this query by a cross-encoder;
    # the answer's vectors are one relevance score per document (dimensions 1)
    query: str | None = None


ToEngine = Generate | Abort | FlushCache | Embed


# ---------------------------------------------------------------- engine -> proxy (outputs)

class TokenLogprob(msgspec.Struct, array_like=True):
    """One generated token's log-probability and the most likely alternatives."""
    token: str
    logprob: float
    top: list[tuple[str, float]] = []


class Delta(msgspec.Struct, array_like=True):
    """One request's progress in one engine step."""
    request_id: str
    text: str = ""
    token_ids: list[int] = []
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    error_code: str | None = None  # e.g. "context_length_exceeded" (a client error)
    cached_tokens: int = 0  # prompt tokens served from the KV cache (RAM or SSD)
    stop_sequence: str | None = None  # the stop string that ended the request, if one did
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids, when asked
    reasoning: str = ""  # a reasoning model's thinking text (not part of `text`)
    tool_calls: list[dict] | None = None  # [{"name", "arguments" (JSON text)}] parsed from output
    prompt_text: str = ""  # the admission notice of a Generate with `echo_prompt`: its prompt


class StepOutput(_Msg, tag="step"):
    engine_id: str
    epoch: int
    deltas: list[Delta]


class EngineStats(msgspec.Struct, array_like=True):
    """An engine's prompt, timing and KV-cache figures (RAM and SSD tiers): `/stats` shows them
    under `cache` as they are named here, `/metrics` exports them."""
    ram_bytes: int = 0
    ram_entries: int = 0
    ram_capacity_bytes: int = 0
    ram_hits: int = 0
    ram_misses: int = 0
    ram_evictions: int = 0
    prompt_tokens: int = 0
    prefilled_tokens: int = 0  # prompt tokens computed so far (chunk by chunk)
    cached_tokens: int = 0  # prompt tokens served from either tier
    checkpoints: int = 0
    checkpoint_s: float = 0.0  # MLX-thread time spent on generation checkpoints
    step_s: float = 0.0  # MLX-thread time in generation steps
    first_tokens: int = 0  # requests that produced a first token (for the two means below)
    to_admit_s: float = 0.0  # sum: engine receipt -> inserted into the batch
    to_first_token_s: float = 0.0  # sum: engine receipt -> first token sampled
    mlx_active_bytes: int = 0  # MLX's allocator: arrays alive
    mlx_cache_bytes: int = 0  # and freed buffers it keeps for reuse
    ssd_state: SsdState = "off"
    ssd_reason: str = ""  # while degraded: "<code>: <why>; writes paused, next try in ..."
    ssd_error_code: str = ""
    ssd_retry_in_s: float = 0.0
    ssd_hits: int = 0
    ssd_misses: int = 0
    ssd_restored_tokens: int = 0
    ssd_blocks_queued: int = 0
    ssd_blocks_written: int = 0
    ssd_blocks_existed: int = 0
    ssd_bytes_written: int = 0
    ssd_write_failures: int = 0
    ssd_skipped_no_slot: int = 0
    ssd_skipped_degraded: int = 0
    ssd_bad_blocks: int = 0
    ssd_bytes: int = 0
    ssd_blocks: int = 0
    ssd_evicted: int = 0
    ssd_write_queue: int = 0
    embed_requests: int = 0  # Embed requests answered with vectors
    embed_inputs: int = 0  # inputs embedded
    embed_tokens: int = 0  # their tokens
    embed_steps: int = 0  # forward passes that embedded them (up to 64 inputs, or a chunk)
    embed_peak_batch: int = 0  # most inputs embedded in one forward pass
    embed_abandoned: int = 0  # requests dropped unfinished: their clients went away
    bursts: int = 0  # requests reaching an idle engine together, prefilled as one batch
    # Speculative decoding (a row decoding alone, or several rows in one verify pass): steps
    # that verified drafts in one forward pass, tokens drafted and accepted, tokens those steps
    # produced, steps run plain because drafting did not pay lately, steps that waited for
    # their last tokens and found no draft; and the ratios (accepted / drafted, tokens / step).
    spec_mode: str = ""  # "ngram" | "draft" | "" (off)
    spec_steps: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_tokens: int = 0
    spec_skipped: int = 0
    spec_missed: int = 0
    spec_batched: int = 0  # of spec_steps, those that verified several rows' drafts at once
    spec_acceptance: float = 0.0
    spec_tokens_per_step: float = 0.0
    # `--batch auto`: the KV bytes this engine's budget allows, and its share of the machine's
    # memory (1.0 alone; with --model-pool N, the part the supervisor granted it)
    kv_budget_bytes: int = 0
    memory_share: float = 1.0
    # What the tiers hold of this model's cache (engine/kv/codec.py): its layers by kind
    # ("kv 16", "kv 4, ring 12 (window 512)", "arrays 24"), the snapshots of state layers held
    # in RAM, and a cache class mlxd cannot hold ("": none; then no tier holds anything).
    # `weights_bytes` and `mlx_active_bytes` beside `ram_bytes` show what MLX holds besides.
    cache_layers: str = ""
    ram_snapshots: int = 0
    cache_unsupported: str = ""
    weights_bytes: int = 0
    # The RAM tier's keep policy (engine/kv/keep_policy.py): entries dropped for a newer one
    # holding all but their last tokens, and the bytes of sessions' entries (evicted after
    # one-offs).
    ram_superseded: int = 0
    ram_kept_bytes: int = 0
    # The longest generation step since the engine started (a running stream's worst wait
    # between two tokens), and how long a step takes now (engine/batch/timing/pace.py: what the hang
    # watchdog is patient for, where it exceeds a third of --hang-timeout).
    longest_step_s: float = 0.0
    pace_s: float = 0.0


# A prompt's text is refused before tokenizing when it has more characters than
# context_length * max_token_bytes * PROMPT_SIZE_SLACK: more than any tokenization could fit
# (the slack leaves room for normalizers that shrink text).
PROMPT_SIZE_SLACK = 4


class EngineStatus(_Msg, tag="status"):
    """Sent by an engine when its state changes and periodically, so that a (re)started proxy
    learns every engine without asking."""
    engine_id: str
    epoch: int
    pid: int
    model_id: str
    model_names: list[str]
    state: EngineState
    active: int = 0
    peak_batch: int = 0
    steps: int = 0
    context_length: int = 0
    error: str | None = None
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    model_spec: str = ""
    stats: EngineStats = msgspec.field(default_factory=EngineStats)
    max_token_bytes: int = 0  # the longest token's text in bytes (0: unknown): lets the proxy
    # refuse a prompt that cannot fit the context without sending it
    # while loading: (task, done, total, unit) of the long step under way, e.g.
    # ("loading weights", 40, 93, "MiB"), for `mlxd status`; None otherwise
    load_progress: tuple[str, int, int, str] | None = None
    # The model as loaded (set once it is): its local directory (the default model's converted
    # one, a repo id's snapshot) and what it can do, in Ollama's words: completion, tools (its
    # chat template takes tools and mlx-lm parses its calls), thinking (its template knows
    # <think>), insert (its tokenizer has fill-in-the-middle tokens)
    model_dir: str = ""
    capabilities: list[str] = []
    # The batch in force now (`--batch auto` or N): the rows the KV budget allows, why (which
    # bound holds, and how the budget was derived), and requests held back until rows finish
    batch_cap: int = 0
    batch_why: str = ""
    waiting: int = 0
    # a sharded engine (rank 0 of a group): its layout ("tensor:2") and its followers'
    # process ids (local ranks, or the ssh clients of remote ones); "" and [] for one process
    group: str = ""
    group_pids: list[int] = []


class CacheFlushed(_Msg, tag="flushed"):
    engine_id: str
    epoch: int
    token: str
    written: int
    failed: int
    pending: int
    error: str | None = None
    # set when the cache is not durable: a StoreDone code (disk_full, read_only, ...), or
    # timeout, no_answer (the proxy heard nothing) or engine_restarted (the engine died or
    # was replaced before answering); None when durable (or no SSD tier)
    error_code: str | None = None
    unwritten: int = 0  # blocks of cached entries still not on disk when the flush answered


class Embeddings(_Msg, tag="embeddings"):
    """The vectors of one `Embed`: `count` rows of `dimensions` float32 (little-endian), one
    after the other, in the order of the inputs."""
    engine_id: str
    epoch: int
    request_id: str
    count: int
    dimensions: int
    vectors: bytes
    prompt_tokens: int = 0  # tokens of every input together (after truncation)


FromEngine = StepOutput | EngineStatus | CacheFlushed | Embeddings


# ---------------------------------------------------------------- control (supervisor <-> child)

class Hello(_Msg, tag="hello"):
    role: Role
    child_id: str
    epoch: int
    pid: int


class Ready(_Msg, tag="ready"):
    child_id: str
    epoch: int
    detail: str = ""  # what a user should know: where the proxy listens, which model loaded


class Heartbeat(_Msg, tag="hb"):
    child_id: str
    epoch: int
    progress: int = 0
    busy: bool = False
    served: int = 0  # an engine's tokens generated (inputs embedded) in this life
    pace_s: float = 0.0  # how long an engine's step takes now (engine/batch/timing/pace.py)


class ChildFailed(_Msg, tag="failed"):
    """A child that cannot work (bad model, bad config) says why before it exits."""
    child_id: str
    epoch: int
    reason: str


class Shutdown(_Msg, tag="shutdown"):
    reason: str = ""
    # The proxy has already stopped (a daemon stopping stops it first): nothing will read an
    # engine's last outputs, so its socket need not wait to deliver them (it would wait its
    # whole linger, a second, for every engine).
    outputs_unread: bool = False


class SetMemoryShare(_Msg, tag="share"):
    """Supervisor -> engine: its part of the machine's memory is now `share` (the engines of a
    model pool changed: daemon/memory_share.py); the engine re-derives its KV budget from it."""
    engine_id: str
    epoch: int
    share: PoolShare


class ChildInfo(msgspec.Struct, array_like=True):
    """The supervisor's view of one child, for /stats and for the proxy's routing."""
    role: Role
    child_id: str
    model: str
    epoch: int
    state: ChildState
    pid: int | None = None
    restarts: int = 0
    last_exit: str | None = None  # "code 1" | "signal 9"
    last_error: str | None = None  # the last error line the child wrote to stderr
    reason: str | None = None  # why it is failed
    heartbeat_age_s: float | None = None


class ChildStates(_Msg, tag="children"):
    """Supervisor -> proxy: every child, sent whenever one changes state."""
    children: list[ChildInfo]


class StartEngine(_Msg, tag="start_engine"):
    """Proxy -> supervisor: load `model` in a new engine child named `engine_id`."""
    engine_id: str
    model: str


class StopEngine(_Msg, tag="stop_engine"):
    """Proxy -> supervisor: unload (stop, and do not restart) an engine."""
    engine_id: str


class ResetChild(_Msg, tag="reset"):
    """Proxy -> supervisor: clear a failed child's crash-loop breaker and start it again."""
    child_id: str


class StopDaemon(_Msg, tag="stop_daemon"):
    """Proxy -> supervisor: `POST /admin/shutdown` asks for what SIGTERM does."""
    reason: str


ToSupervisor = (Hello | Ready | Heartbeat | ChildFailed | StartEngine | StopEngine | ResetChild
                | StopDaemon)
ToChild = Shutdown | ChildStates | SetMemoryShare


# ---------------------------------------------------------------- engine <-> storage worker

class BlockWrite(msgspec.Struct, array_like=True):
    """One block's bytes are in shared-memory slot `slot` (payload layout, from its start)."""
    slot: int
    parent: bytes
    key: bytes
    tokens: list[int]
    tail: bool = False
    # a state snapshot taken where this block ends (protocol/block_format.py): its payload is
    # `nbytes` long and its file is `snap_file(..., key)`
    snapshot: bool = False
    nbytes: int = 0


class StoreBlocks(_Msg, tag="store"):
    engine_id: str
    epoch: int
    segment: str  # shared-memory segment name
    slot_bytes: int
    namespace: bytes
    layout: Layout
    blocks: list[BlockWrite]


class TouchBlocks(_Msg, tag="touch"):
    """Blocks just restored: most recently used for the SSD cap's LRU."""
    namespace: bytes
    names: list[str]


class StoreDone(_Msg, tag="stored"):
    slots: list[int]  # free again
    written: int = 0
    existed: int = 0
    failed: int = 0
    bytes_written: int = 0
    error: str | None = None  # set while the SSD tier cannot write (full, read-only, gone)
    disk_bytes: int = 0
    disk_blocks: int = 0
    evicted: int = 0
    # why `failed` blocks were not written: disk_full, read_only, permission_denied, gone (the
    # cache dir vanished), io_error, shm_gone; the engine's own: copy_failed, worker_gone
    error_code: str | None = None


class ProbeDisk(_Msg, tag="probe"):
    """While an engine's SSD tier is degraded: could a block of `nbytes` be written now? The
    worker makes room for one in a temporary file and gives it back (`DiskProbed`)."""
    nbytes: int


class DiskProbed(_Msg, tag="probed"):
    error_code: str | None = None  # None: the disk takes writes; else as StoreDone's
    error: str | None = None


ToStorage = StoreBlocks | TouchBlocks | ProbeDisk
FromStorage = StoreDone | DiskProbed
