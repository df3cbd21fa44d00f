"""Property-based fuzzing of every endpoint against a real daemon (in-process and --isolate):
never a 5xx, never a hang, every error JSON in the endpoint's own dialect, and afterwards the
engine serves a normal request on the same epoch (it never restarted) behind the same proxy.

Repeatable in CI (derandomized); MLXD_FUZZ_EXAMPLES sets the requests per daemon mode
(default 13 per endpoint, spread over the endpoints), so a long run can ask for 10,000+."""

from __future__ import annotations

import os
from dataclasses import dataclass

import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from conftest import start_daemon, stop_and_check
from support.fuzz_requests import NOT_FUZZED, FuzzRequest, covered_routes, endpoints, problems
from support.harness import Daemon
from support.routes import served_routes

ENDPOINTS = sorted(endpoints("tiny"))
# 13 per endpoint: what 260 gave each of the 21 before the routes added since had generators
EXAMPLES = int(os.environ.get("MLXD_FUZZ_EXAMPLES", str(13 * len(ENDPOINTS))))
PER_ENDPOINT = max(1, -(-EXAMPLES // len(ENDPOINTS)))
HANG_S = 30.0  # a response slower than this is a hang (the slowest valid request takes < 1 s)


@dataclass
class Target:
    """A daemon under fuzzing, a client on each of its transports, and its stats before."""
    daemon: Daemon
    tcp: httpx.Client
    unix: httpx.Client
    before: dict


@pytest.fixture(scope="module", params=["inprocess", "isolate"])
def target(request, tiny_model):
    # --max-tokens 4: a fuzzed request that happens to be valid generates a few tokens only.
    d = start_daemon(tiny_model, "--max-tokens", "4", isolate=request.param == "isolate")
    before = d.stats()
    tcp, unix = d.http(timeout=HANG_S), d.unix_http()
    unix.timeout = httpx.Timeout(HANG_S)
    try:
        yield Target(d, tcp, unix, before)
    finally:
        tcp.close()
        unix.close()
        stop_and_check(d)


def send(t: Target, req: FuzzRequest) -> list[str]:
    client = t.unix if req.unix else t.tcp
    try:
        r = client.request(req.method, req.path, headers=req.headers, content=req.body)
    except httpx.TimeoutException:
        return [f"no answer within {HANG_S}s"]
    except httpx.HTTPError as e:
        return [f"transport error: {type(e).__name__}: {e}"]
    return problems(req, r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content)


def test_every_served_route_has_a_generator():
    """Coverage by construction: the routes the proxy's router serves, each sent to by some
    generator (a generator for a route not served yet is fine: it gets 404s until it is)."""
    served = served_routes()
    missing = served - covered_routes() - set(NOT_FUZZED)
    assert not missing, ("routes no fuzz generator sends to (add one to "
                         f"tests/support/fuzz_requests.py): {sorted(missing)}")
    assert set(NOT_FUZZED) <= served, "a route kept out of fuzzing is no longer served"


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_fuzz(target, endpoint):
    model = target.before["engines"][0]["model"]

    @settings(max_examples=PER_ENDPOINT, derandomize=True, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate, Phase.shrink], print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(endpoints(model)[endpoint])
    def fuzz(req: FuzzRequest) -> None:
        found = send(target, req)
        assert not found, (f"{req.method} {req.path[:200]} headers={str(req.headers)[:200]} "
                           f"body={req.body[:300]!r}: {found}")

    fuzz()


def test_engine_unharmed_after_fuzzing(target):
    """Runs after the fuzz cases of its module (pytest keeps file order within a fixture)."""
    with target.daemon.http() as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    after = target.daemon.stats()
    eng, eng0 = after["engines"][0], target.before["engines"][0]
    assert eng["state"] == "ready" and eng["epoch"] == eng0["epoch"] and eng["pid"] == eng0["pid"]
    assert after["proxy"]["pid"] == target.before["proxy"]["pid"]  # the proxy never restarted
    assert not after["proxy"]["draining"]
    assert all(c["restarts"] == 0 for c in after["children"]), after["children"]
