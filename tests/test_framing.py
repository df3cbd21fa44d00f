"""Raw-socket HTTP framing abuse against the real server, on TCP and on the Unix socket: each
abuse gets a 4xx or a closed connection (never a 5xx, never a wedged daemon), and the daemon
keeps serving normal requests meanwhile and afterwards."""

from __future__ import annotations

import re
import socket
import time

import pytest

from conftest import start_daemon, stop_and_check
from support.harness import Daemon

H = b"Host: 127.0.0.1\r\n"
BODY = b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}'
CHAT = b"POST /v1/chat/completions HTTP/1.1\r\n" + H
STATUS = re.compile(rb"HTTP/1\.[01] (\d{3}) ")


@pytest.fixture(scope="module")
def d(tiny_model):
    daemon = start_daemon(tiny_model, "--max-tokens", "4")
    yield daemon
    stop_and_check(daemon)


def connect(d: Daemon, transport: str, timeout: float = 5.0) -> socket.socket:
    if transport == "tcp":
        s = socket.create_connection(("127.0.0.1", d.port), timeout=timeout)
    else:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        s.connect(d.socket)
    return s


def exchange(d: Daemon, transport: str, data: bytes, wait: float = 3.0,
             responses: int = 1) -> bytes:
    """Send `data`; return what came back once `responses` whole final responses arrived, the
    server closed, or `wait` seconds passed (then the client gives up and closes)."""
    s = connect(d, transport, wait)
    out = b""
    try:
        s.sendall(data)
        while len(final_responses(out)) < responses:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    except (TimeoutError, ConnectionResetError, BrokenPipeError):
        pass
    finally:
        s.close()
    return out


def final_responses(raw: bytes) -> list[int]:
    """The statuses of the complete non-1xx responses (with a Content-Length) in `raw`."""
    done, pos = [], 0
    while (m := STATUS.search(raw, pos)) is not None:
        end = raw.find(b"\r\n\r\n", m.start())
        if end < 0:
            break
        length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", raw[m.start():end])
        pos = end + 4 + (int(length.group(1)) if length else 0)
        if pos > len(raw):
            break
        if int(m.group(1)) >= 200:
            done.append(int(m.group(1)))
    return done


def statuses(raw: bytes) -> list[int]:
    return [int(m.group(1)) for m in STATUS.finditer(raw)]


def assert_serving(d: Daemon, transport: str) -> None:
    raw = exchange(d, transport, CHAT + b"Connection: close\r\nContent-Length: %d\r\n\r\n"
                   % len(BODY) + BODY, wait=30)
    assert statuses(raw) == [200], raw[:500]
    assert b'"completion_tokens": 2' in raw


# Each abuse and what it must get: a status, or None for no answer (the server waits for
# bytes that never come, until the client gives up).
ABUSE: dict[str, tuple[bytes, int | None]] = {
    "request line over the limit": (b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\n" + H + b"\r\n",
                                    400),
    "header over the limit": (b"GET /health HTTP/1.1\r\n" + H + b"X-A: " + b"a" * 10_000
                              + b"\r\n\r\n", 400),
    "thousands of headers": (b"GET /health HTTP/1.1\r\n" + H
                             + b"".join(b"X-%d: 1\r\n" % i for i in range(5000)) + b"\r\n", 400),
    "negative content-length": (CHAT + b"Content-Length: -1\r\n\r\n" + BODY, 400),
    "content-length past 2**64": (CHAT + b"Content-Length: 99999999999999999999999\r\n\r\n",
                                  400),
    "content-length over the body limit": (CHAT + b"Content-Length: 999999999\r\n\r\n" + BODY,
                                           413),
    "expect 100-continue over the body limit": (CHAT + b"Expect: 100-continue\r\n"
                                                b"Content-Length: 999999999\r\n\r\n", 413),
    "duplicated content-length": (CHAT + b"Content-Length: %d\r\nContent-Length: 5\r\n\r\n"
                                  % len(BODY) + BODY, 400),
    "non-numeric content-length": (CHAT + b"Content-Length: 12abc\r\n\r\n" + BODY, 400),
    "chunk size not hex": (CHAT + b"Transfer-Encoding: chunked\r\n\r\nZZ\r\nabc\r\n0\r\n\r\n",
                           400),
    "chunk size overflow": (CHAT + b"Transfer-Encoding: chunked\r\n\r\n" + b"F" * 22
                            + b"\r\nabc\r\n0\r\n\r\n", 400),
    "chunk shorter than its size": (CHAT + b"Transfer-Encoding: chunked\r\n\r\n"
                                    b"ff\r\nabc\r\n0\r\n\r\n", None),
    "chunked and content-length": (CHAT + b"Transfer-Encoding: chunked\r\nContent-Length: 3"
                                   b"\r\n\r\n3\r\nabc\r\n0\r\n\r\n", 400),
    "unknown transfer-coding": (CHAT + b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
                                400),
    "chunked trailer over the limit": (CHAT + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n"
                                       % len(BODY) + BODY + b"\r\n0\r\nX-T: " + b"a" * 20_000
                                       + b"\r\n\r\n", 400),
    "gzip body that is not gzip": (CHAT + b"Content-Encoding: gzip\r\nContent-Length: 10"
                                   b"\r\n\r\n0123456789", 400),
    "HTTP/0.9": (b"GET /\r\n", None),
    "HTTP/9.9": (b"GET / HTTP/9.9\r\n" + H + b"\r\n", 400),
    "HTTP/2 preface": (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400),
    "garbage bytes": (bytes(range(256)) * 4, 400),
    "NUL in the method": (b"G\x00T / HTTP/1.1\r\n" + H + b"\r\n", 400),
    "NUL in a header": (b"GET /health HTTP/1.1\r\n" + H + b"X-A: a\x00b\r\n\r\n", 400),
    "obsolete header folding": (b"GET /health HTTP/1.1\r\n" + H + b"X-A: a\r\n b\r\n\r\n", 400),
    "no Host in HTTP/1.1": (b"GET /health HTTP/1.1\r\n\r\n", 400),
}


@pytest.mark.parametrize("transport", ["tcp", "unix"])
@pytest.mark.parametrize("name", list(ABUSE))
def test_abuse_gets_4xx_or_close(d, transport, name):
    data, expected = ABUSE[name]
    started = time.monotonic()
    raw = exchange(d, transport, data, wait=2.0)
    got = final_responses(raw)
    if expected is None:
        assert got == [], raw[:500]
    else:
        assert got == [expected], raw[:500]
        assert time.monotonic() - started < 2.0  # answered, not timed out
        if expected >= 400 and b"application/json" in raw.partition(b"\r\n\r\n")[0]:
            assert b'"error"' in raw  # an error the handlers saw is in the API's envelope


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_daemon_serves_after_all_abuse(d, transport):
    assert_serving(d, transport)
    stats = d.stats()
    assert stats["engines"][0]["epoch"] == 0 and stats["engines"][0]["active_requests"] == 0


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_body_shorter_than_content_length_then_close(d, transport):
    s = connect(d, transport)
    s.sendall(CHAT + b"Content-Length: 1000\r\n\r\n" + BODY)
    assert_serving(d, transport)  # the half-sent request holds nothing up
    s.close()
    assert_serving(d, transport)


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_slowloris_body_does_not_block_others(d, transport):
    """A body at one byte a second: the others are served meanwhile (the test waits ~3 s)."""
    s = connect(d, transport)
    s.sendall(CHAT + b"Content-Length: %d\r\n\r\n" % len(BODY))
    try:
        for i in range(3):
            s.sendall(BODY[i:i + 1])
            started = time.monotonic()
            assert_serving(d, transport)
            assert time.monotonic() - started < 10
            time.sleep(1.0)  # the slow client's pace, not a wait for the daemon
    finally:
        s.close()
    assert_serving(d, transport)


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_slowloris_headers_do_not_block_others(d, transport):
    s = connect(d, transport)
    try:
        for b in b"GET /health HTTP/1.1\r\nX-Slow:":
            s.sendall(bytes([b]))
        assert_serving(d, transport)
    finally:
        s.close()


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_pipelined_requests_are_answered_in_order(d, transport):
    data = (b"GET /health HTTP/1.1\r\n" + H + b"\r\n"
            + CHAT + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY
            + CHAT + b"Content-Length: 9\r\n\r\n{not json"
            + b"GET /v1/models HTTP/1.1\r\n" + H + b"Connection: close\r\n\r\n")
    raw = exchange(d, transport, data, wait=30, responses=4)
    assert statuses(raw) == [200, 200, 400, 200], raw[:2000]


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_pipelined_after_garbage_is_not_served(d, transport):
    """A broken request ends the connection: nothing pipelined behind it runs."""
    data = b"G\x00T / HTTP/1.1\r\n" + H + b"\r\n" + CHAT + b"Content-Length: %d\r\n\r\n" \
        % len(BODY) + BODY
    raw = exchange(d, transport, data)
    assert statuses(raw) == [400], raw[:500]


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_client_closing_mid_stream_aborts_its_request(d, transport):
    body = b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":200,"stream":true}'
    s = connect(d, transport, timeout=30)
    s.sendall(CHAT + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    got = b""
    while got.count(b"data: ") < 3:  # the stream is running
        chunk = s.recv(4096)
        assert chunk, got
        got += chunk
    assert statuses(got) == [200]
    s.close()  # mid-stream
    d.wait_until(lambda st: st["engines"][0]["active_requests"] == 0, timeout=30,
                 what="the abandoned stream to be aborted")
    assert_serving(d, transport)
