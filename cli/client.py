"""`mlxd status | models | flush | stop | socket`, and the HTTP under `mlxd chat | run`: talk
to the running daemon over its Unix socket (no API key needed there: the socket's 0600 mode is
the credential)."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

STREAM_READ_TIMEOUT = 900.0  # seconds without a byte from a streaming answer: given up


class DaemonUnreachable(Exception):
    pass


class ApiError(Exception):
    """The daemon answered with an error: a status before the answer, or an in-band error
    event during it (status 200 then)."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(str(self.path))
        self.sock = sock


def call(sock_path: Path, method: str, path: str, body: dict | None = None,
         timeout: float = 30.0) -> tuple[int, Any]:
    conn = _UnixConnection(sock_path, timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
    except (FileNotFoundError, ConnectionRefusedError) as e:
        raise DaemonUnreachable(f"no mlxd answers on {sock_path} ({e.strerror})") from None
    except OSError as e:
        raise DaemonUnreachable(f"mlxd on {sock_path}: {e}") from None
    finally:
        conn.close()
    try:
        return resp.status, json.loads(raw)
    except ValueError:
        return resp.status, raw.decode(errors="replace")


@dataclass
class StreamEnd:
    finish_reason: str | None
    text: str  # the whole answer


def stream_chat(sock_path: Path, body: dict, on_text: Callable[[str, str], None]) -> StreamEnd:
    """POST /v1/chat/completions with `stream: true`; `on_text(content, reasoning)` hears each
    piece as it comes. Raises ApiError, DaemonUnreachable; a KeyboardInterrupt closes the
    connection, which makes the daemon stop generating."""
    conn = _UnixConnection(sock_path, STREAM_READ_TIMEOUT)
    try:
        try:
            conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True}),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
        except (FileNotFoundError, ConnectionRefusedError) as e:
            raise DaemonUnreachable(f"no mlxd answers on {sock_path} ({e.strerror})") from None
        except OSError as e:
            raise DaemonUnreachable(f"mlxd on {sock_path}: {e}") from None
        if resp.status != 200:
            raise _api_error(resp.status, resp.read())
        return _read_stream(resp, on_text)
    finally:
        conn.close()


def _api_error(status: int, raw: bytes) -> ApiError:
    try:
        err = json.loads(raw).get("error") or {}
        return ApiError(status, str(err.get("message") or raw[:500]), err.get("code"))
    except (ValueError, AttributeError):
        return ApiError(status, raw[:500].decode(errors="replace"))


def _read_stream(resp: http.client.HTTPResponse,
                 on_text: Callable[[str, str], None]) -> StreamEnd:
    finish, text = None, []
    while True:
        line = resp.readline()
        if not line:
            break
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            err = chunk["error"] or {}
            raise ApiError(200, str(err.get("message")), err.get("code"))
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            content, reasoning = delta.get("content") or "", delta.get("reasoning_content") or ""
            if content or reasoning:
                text.append(content)
                on_text(content, reasoning)
            finish = choice.get("finish_reason") or finish
    return StreamEnd(finish, "".join(text))


def _size(n: float | int | str | None) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _duration(s: float | int) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)).rstrip()
             for r in [header, *rows]]
    return "\n".join(lines)


def engine_state(engine: dict) -> str:
    """An engine's state, with how far a loading one has come."""
    progress = engine.get("load_progress")
    if engine.get("state") != "loading" or not progress:
        group = engine.get("group")
        return f"{engine.get('state')} ({group})" if group else str(engine.get("state"))
    task, done, total, unit = progress
    pct = f"{100 * done // total}%, " if total else ""
    return f"loading ({task}: {pct}{done}/{total} {unit})"


def _rows(engine: dict) -> str:
    """Rows decoding / the batch cap in force (`--batch auto` or N), and requests held back."""
    cap = engine.get("batch_cap") or 0
    shown = f"{engine['active_requests']}/{cap}" if cap else str(engine["active_requests"])
    waiting = engine.get("waiting_requests") or 0
    return shown + (f" +{waiting} waiting" if waiting else "")


def _kv_budget(engine: dict) -> str:
    """The KV memory `--batch auto` sizes the batch from, and the engine's share of the
    machine's memory when it is one of a pool's."""
    c = engine.get("cache") or {}
    if not c.get("kv_budget_bytes") or engine.get("state") in ("stopped", "unloaded"):
        return "-"
    share = c.get("memory_share", 1.0)
    return _size(c["kv_budget_bytes"]) + (f" ({share:.0%} share)" if share < 1 else "")


def format_status(stats: dict, sock: Path | None = None) -> str:
    p = stats["proxy"]
    out = [f"mlxd: up {_duration(p['uptime_s'])}, proxy pid {p['pid']}, "
           f"{p['in_flight']} request(s) in flight"
           + (", DRAINING" if p.get("draining") else "")]
    if sock is not None:
        out.append(f"socket: {sock}")
    if stats.get("children"):
        rows = [[c["role"], c["child_id"], c["state"], str(c["pid"] or "-"), str(c["epoch"]),
                 str(c["restarts"]), c.get("last_exit") or "-"] for c in stats["children"]]
        out += ["", table(rows, ["ROLE", "ID", "STATE", "PID", "EPOCH", "RESTARTS",
                                 "LAST EXIT"])]
    rows = []
    for e in stats["engines"]:
        c = e.get("cache") or {}
        rows.append([e["model"], engine_state(e), _rows(e), _kv_budget(e),
                     str(e["generated_tokens_total"]),
                     f"{_size(c.get('ram_bytes'))} ({c.get('ram_hits', 0)} hits)",
                     f"{_size(c.get('ssd_bytes'))} ({c.get('ssd_hits', 0)} hits)"
                     if c.get("ssd_state", "off") != "off" else "off",
                     (e.get("error") or "")[:60]])
    out += ["", table(rows, ["MODEL", "STATE", "ROWS/CAP", "KV BUDGET", "GENERATED",
                             "RAM CACHE", "SSD CACHE", "ERROR"])]
    whys = [f"  {e['model']}: {e['batch_why']}" for e in stats["engines"] if e.get("batch_why")]
    if whys:
        out += ["", "batch cap, why:", *whys]
    held = [f"  {e['model']}: {cache_holds(e.get('cache') or {})}" for e in stats["engines"]
            if (e.get("cache") or {}).get("cache_layers")]
    if held:
        out += ["", "KV cache, what it holds:", *held]
    r = p.get("resume") or {}
    if r.get("resumes"):
        out += ["", f"resumed after crashes: {r['resumes']} request(s), "
                    f"{r['resumed_tokens']} token(s) kept"]
    return "\n".join(out)


def cache_holds(c: dict) -> str:
    """An engine's cache layers, snapshots, and what the RAM tier counts beside what MLX holds
    beyond the weights (a gap between the two would be memory the tier does not count)."""
    if c.get("cache_unsupported"):
        return f"{c['cache_layers']}; no cache tiers: mlxd cannot hold {c['cache_unsupported']}"
    out = c["cache_layers"]
    if c.get("ram_snapshots"):
        out += f"; {c['ram_snapshots']} state snapshot(s)"
    beyond = max(0, c.get("mlx_active_bytes", 0) - c.get("weights_bytes", 0))
    out += (f"; RAM tier {_size(c.get('ram_bytes'))} counted (sessions' "
            f"{_size(c.get('ram_kept_bytes'))}) of {_size(c.get('ram_capacity_bytes'))}, MLX "
            f"holds {_size(beyond)} beyond the weights")
    if c.get("ram_superseded"):
        out += f"; {c['ram_superseded']} entries superseded by their next turn"
    return out


def format_models(models: dict) -> str:
    rows = [[m["id"], m.get("state", "-"), str(m.get("context_length") or "-"),
             ", ".join(a for a in m.get("aliases", []) if a != m["id"])]
            for m in models["data"]]
    return table(rows, ["MODEL", "STATE", "CONTEXT", "ALSO KNOWN AS"])


def wait_for_exit(pid: int | None, sock_path: Path, timeout: float) -> bool:
    """True once the daemon process is gone (or, without its pid, its socket)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pid is not None:
            if not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie":
                return True
        elif not sock_path.exists():
            return True
        time.sleep(0.1)  # polling another process's exit: there is no event to await
    return False


def daemon_pid(run_dir: Path) -> int | None:
    try:
        return int((run_dir / "lock").read_text().strip())
    except (OSError, ValueError):
        return None


def running_pid(run_dir: Path) -> int | None:
    """The pid of the daemon running with `run_dir`, or None (no lock, or a dead one's)."""
    pid = daemon_pid(run_dir)
    try:
        if pid is not None and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            return pid
    except psutil.Error:
        pass
    return None


def socket_in(run_dir: Path) -> Path | None:
    """The Unix socket of the daemon with `run_dir`: what its listen.json names (None if it
    serves none), else the default RUN_DIR/mlxd.sock."""
    try:
        listen = json.loads((run_dir / "listen.json").read_text())
    except (OSError, ValueError):
        return run_dir / "mlxd.sock"
    sock = listen.get("socket") if isinstance(listen, dict) else None
    return Path(sock) if sock else None
