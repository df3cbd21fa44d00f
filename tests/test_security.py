"""Local security and metrics against real daemons: Host and Origin checks, the API key,
/admin/* only on the Unix socket (or with the key), header limits, file modes, /metrics."""

from __future__ import annotations

import stat
import tempfile
from pathlib import Path

import httpx2 as httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import start_daemon, stop_and_check

KEY = "test-key-0123456789"


@pytest.fixture(scope="module")
def open_daemon(tiny_model, tmp_path_factory):
    # Both directories start world-readable: the daemon must make them private.
    cache = tmp_path_factory.mktemp("cache")
    run_dir = Path(tempfile.mkdtemp(prefix="mlxd-t-", dir="/tmp"))  # short: socket paths
    for path in (cache, run_dir):
        path.chmod(0o755)
    d = start_daemon(tiny_model, "--allowed-host", "mybox.lan",
                     "--cors-origin", "https://chat.example", cache_dir=cache, run_dir=run_dir)
    yield d
    stop_and_check(d)


@pytest.fixture(scope="module")
def keyed_daemon(tiny_model):
    d = start_daemon(tiny_model, isolate=True, env={"MLXD_API_KEY": KEY})
    yield d
    stop_and_check(d)


def test_dns_rebinding_host_is_refused(open_daemon):
    with open_daemon.http() as c:
        r = c.get("/v1/models", headers={"Host": "attacker.example"})
        assert r.status_code == 403
        assert r.json()["error"]["code"] == "host_not_allowed"
        assert r.json()["error"]["type"] == "permission_error"
        r = c.post("/v1/chat/completions", headers={"Host": "attacker.example:8080"},
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert r.status_code == 403
        for host in (f"localhost:{open_daemon.port}", "127.0.0.1", "[::1]:80", "mybox.lan:1"):
            assert c.get("/v1/models", headers={"Host": host}).status_code == 200, host


def test_browser_origins(open_daemon):
    with open_daemon.http() as c:
        r = c.get("/v1/models", headers={"Origin": "https://evil.example"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
        assert "Access-Control-Allow-Origin" not in r.headers
        r = c.post("/v1/completions", headers={"Origin": "null"},
                   json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 403  # a sandboxed iframe of some web page
        for origin in ("https://chat.example", "http://localhost:3000", "app://desktop-app"):
            r = c.get("/v1/models", headers={"Origin": origin})
            assert r.status_code == 200, origin
            assert r.headers["Access-Control-Allow-Origin"] == origin
        pre = c.options("/v1/chat/completions", headers={
            "Origin": "https://chat.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type, authorization"})
        assert pre.status_code == 204
        assert "POST" in pre.headers["Access-Control-Allow-Methods"]
        assert pre.headers["Access-Control-Allow-Headers"] == "content-type, authorization"
        assert c.options("/v1/chat/completions", headers={
            "Origin": "https://evil.example"}).status_code == 403


def test_admin_only_on_the_unix_socket(open_daemon):
    with open_daemon.http() as c:
        for path in ("/admin/cache/flush", "/admin/drain", "/admin/shutdown"):
            r = c.post(path)
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_not_allowed"
    with open_daemon.unix_http() as u:
        assert u.post("/admin/cache/flush").status_code == 200
        # the Unix socket needs no Host or key: browsers cannot reach it
        assert u.get("/v1/models", headers={"Host": "attacker.example"}).status_code == 200


def test_oversized_header_is_refused(open_daemon):
    with open_daemon.http() as c:
        r = c.get("/v1/models", headers={"X-Big": "a" * 9000})
        assert r.status_code in (400, 431)
        assert c.get("/v1/models").status_code == 200  # and the daemon is fine


def test_file_modes(open_daemon):
    def mode(p):
        return stat.S_IMODE(p.stat().st_mode)

    assert mode(open_daemon.run_dir) == 0o700
    assert mode(open_daemon.cache_dir) == 0o700
    assert mode(open_daemon.cache_dir / "kv") == 0o700
    assert mode(Path(open_daemon.socket)) == 0o600


@pytest.mark.parametrize("which", ["open_daemon", "keyed_daemon"])  # one process; --isolate
def test_everything_in_the_run_dir_is_private(which, request):
    """Every socket and file in the run dir (ZeroMQ's ipc sockets, the shared-memory
    manifest, listen.json, the lock) is 0600 and every directory 0700, whatever the umask."""
    d = request.getfixturevalue(which)
    seen = {}
    for p in [d.run_dir, *d.run_dir.rglob("*")]:
        seen[p.name] = stat.S_IMODE(p.lstat().st_mode)
        assert seen[p.name] == (0o700 if p.is_dir() else 0o600), (p, oct(seen[p.name]))
    assert {"listen.json", "lock", "store.sock", "shm.list"} <= set(seen), seen
    if which == "keyed_daemon":
        assert {"ctl.sock", "req.sock", "out.sock"} <= set(seen), seen


def _metrics(c: httpx.Client) -> dict[tuple[str, tuple], float]:
    text = c.get("/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _get(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_move_with_traffic(open_daemon, tiny_model):
    model = tiny_model.name
    with open_daemon.http() as c:
        before = _metrics(c)
        r = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "count"}], "max_tokens": 12})
        assert r.status_code == 200
        usage = r.json()["usage"]
        c.get("/v1/models", headers={"Host": "attacker.example"})  # a 403, counted too
        after = _metrics(c)
    route = dict(route="/v1/chat/completions", method="POST", status="200")
    assert _get(after, "mlxd_http_requests_total", **route) == \
        _get(before, "mlxd_http_requests_total", **route) + 1
    forbidden = dict(route="/v1/models", method="GET", status="403")
    assert _get(after, "mlxd_http_requests_total", **forbidden) == \
        _get(before, "mlxd_http_requests_total", **forbidden) + 1
    for name, key in (("mlxd_completion_tokens_total", "completion_tokens"),
                      ("mlxd_prompt_tokens_total", "prompt_tokens")):
        assert _get(after, name, model=model) - _get(before, name, model=model) == usage[key]
    assert _get(after, "mlxd_time_to_first_token_seconds_count", model=model) == \
        _get(before, "mlxd_time_to_first_token_seconds_count", model=model) + 1
    assert _get(after, "mlxd_inter_token_latency_seconds_count", model=model) >= \
        _get(before, "mlxd_inter_token_latency_seconds_count", model=model) + \
        usage["completion_tokens"] - 1
    assert _get(after, "mlxd_engine_state", model=model, engine_id=_engine(open_daemon),
                state="ready") == 1
    assert ("mlxd_cache_bytes", (("model", model), ("tier", "ram"))) in after
    assert _get(after, "mlxd_requests_in_flight") == 0


def _engine(d) -> str:
    return d.stats()["engines"][0]["engine_id"]


def test_api_key_on_tcp(keyed_daemon):
    body = {"prompt": "x", "max_tokens": 2}
    with keyed_daemon.http() as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.post("/v1/completions", json=body,
                      headers={"Authorization": "Bearer wrong-key-000"}).status_code == 401
        assert c.post("/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert c.post("/v1/completions", json=body, headers={"x-api-key": KEY}).status_code == 200
        assert c.get("/health").status_code == 200  # liveness needs no key
        assert c.post("/admin/cache/flush").status_code == 401
        assert c.post("/admin/cache/flush",
                      headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    with keyed_daemon.unix_http() as u:  # the socket's mode is the credential
        assert u.post("/v1/completions", json=body).status_code == 200
        proxy_pid = u.get("/stats").json()["proxy"]["pid"]
    # the key reached the proxy child through its environment, not its command line
    proxy = psutil.Process(proxy_pid)
    assert KEY not in " ".join(proxy.cmdline())
