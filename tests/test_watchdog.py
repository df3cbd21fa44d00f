"""Pure logic of the hardening work (issue 12): the hang watchdog (busy engines without
progress, silent children, the proxy's liveness), the stderr line splitter, the bounded log
formatter, the health probe's parsing, and, on real pipes and sockets but without processes,
the stderr pump, the probe and the Unix-socket claim."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import threading

import pytest

from mlxd.daemon.health_probe import ProbeAddress, parse_status_line, probe
from mlxd.daemon.stderr_pump import LINE_CAP, LineSplitter, drain
from mlxd.daemon.watchdog import KILL_GRACE, PACE_FACTOR, HangWatchdog, probe_timing
from mlxd.protocol.listen_address import ListenError, claim_unix_path
from mlxd.protocol.logs import MESSAGE_CAP, TRACEBACK_CAP, BoundedFormatter, shorten

# ------------------------------------------------------------------ watchdog


def test_probed_child_that_heartbeats_but_never_answers_is_aborted_then_killed():
    w = HangWatchdog(timeout=2)
    w.watch("proxy", 100.0, probed=True)
    for t in (100.5, 101.0, 101.5, 102.0, 102.5):
        w.beat("proxy", 0, False, t)
        assert w.check("proxy", t) is None  # answered_at 100.0: 2.5 s is not > 2 yet at 102
        if t == 101.0:
            w.answered("proxy", t)
    w.beat("proxy", 0, False, 103.1)
    assert w.check("proxy", 103.1) == "abort"
    assert "health probe" in w.why("proxy")
    assert w.check("proxy", 103.1 + KILL_GRACE - 0.1) is None
    assert w.check("proxy", 103.1 + KILL_GRACE) == "kill"


def test_probed_child_that_answers_lives_and_silence_is_named():
    w = HangWatchdog(timeout=2)
    w.watch("proxy", 0.0, probed=True)
    for i in range(1, 20):
        w.beat("proxy", 0, False, i * 0.5)
        w.answered("proxy", i * 0.5)
        assert w.check("proxy", i * 0.5) is None
    assert w.check("proxy", 9.5 + 2.1) == "abort"  # both stopped: silence is named first
    assert w.why("proxy").startswith("no heartbeat")


def test_ready_resets_the_clocks_of_a_child_that_was_slow_to_start():
    w = HangWatchdog(timeout=2)
    w.beat("proxy", 0, False, 0.0)  # a heartbeat long before it became ready
    w.watch("proxy", 50.0, probed=True)
    assert w.check("proxy", 51.0) is None
    w.forget("proxy")
    assert w.check("proxy", 1000.0) is None  # a new epoch is not judged before it beats


def test_unprobed_engine_is_not_judged_on_answers_and_zero_disables():
    w = HangWatchdog(timeout=2)
    w.watch("e", 0.0)
    w.beat("e", 1, False, 10.0)
    assert w.check("e", 10.0) is None
    off = HangWatchdog(timeout=0)
    off.watch("p", 0.0, probed=True)
    assert off.check("p", 1e6) is None


@pytest.mark.parametrize("timeout", [0.5, 2.0, 60.0, 3600.0])
def test_several_probes_fit_in_one_hang_timeout(timeout):
    interval, per_probe = probe_timing(timeout)
    assert interval + per_probe < timeout and per_probe <= 5.0 and interval <= 5.0


def test_watchdog_aborts_a_busy_engine_without_progress_then_kills():
    w = HangWatchdog(timeout=5)
    w.beat("e", 10, True, 0)
    w.beat("e", 11, True, 4)  # progress moved at t=4
    assert w.check("e", 8) is None
    w.beat("e", 11, True, 9.5)
    assert w.check("e", 9.5) == "abort"
    assert w.check("e", 9.5 + KILL_GRACE - 0.1) is None
    assert w.check("e", 9.5 + KILL_GRACE) == "kill"


def test_an_engine_whose_steps_outlast_the_timeout_gets_a_few_of_its_own_steps():
    """Slow hardware: each step takes 3 s against a 2 s timeout. The engine says so with every
    beat, and is called hung only after PACE_FACTOR such steps without progress; a pace well
    under the timeout changes nothing."""
    w = HangWatchdog(timeout=2)
    w.beat("e", 1, True, 0, pace_s=3.0)
    w.beat("e", 1, True, 2.5, pace_s=3.0)
    assert w.check("e", 2.5) is None  # past the timeout, inside its own step
    w.beat("e", 2, True, 3.0, pace_s=3.0)  # the step ended: progress
    w.beat("e", 2, True, 3.0 + PACE_FACTOR * 3.0 - 0.1, pace_s=3.0)
    assert w.check("e", 3.0 + PACE_FACTOR * 3.0 - 0.1) is None
    w.beat("e", 2, True, 3.0 + PACE_FACTOR * 3.0 + 0.1, pace_s=3.0)
    assert w.check("e", 3.0 + PACE_FACTOR * 3.0 + 0.1) == "abort"
    assert w.why("e") == "no progress for 9 s while busy (its steps take 3.0 s)"
    fast = HangWatchdog(timeout=2)
    fast.beat("e", 1, True, 0, pace_s=0.05)
    fast.beat("e", 1, True, 2.1, pace_s=0.05)
    assert fast.check("e", 2.1) == "abort" and fast.why("e") == "no progress for 2 s while busy"


def test_watchdog_ignores_idle_engines_but_not_silent_ones():
    w = HangWatchdog(timeout=5)
    w.beat("e", 3, False, 0)
    w.beat("e", 3, False, 100)
    assert w.check("e", 100) is None  # idle, no progress expected
    assert w.check("e", 106) == "abort"  # no heartbeat at all for > 5 s


def test_a_starting_child_is_judged_only_on_staying_stopped():
    w = HangWatchdog(timeout=2)
    w.beat("e", 0, True, 0.0)  # a load's beats say nothing: no progress is no hang here
    for t in (0.5, 5.0, 50.0):
        assert w.stopped("e", False, t) is None
    assert w.stopped("e", True, 60.0) is None  # stopped: the clock starts
    assert w.stopped("e", True, 61.5) is None
    assert w.stopped("e", False, 61.9) is None  # SIGCONT: it runs again, the clock is gone
    assert w.stopped("e", True, 62.0) is None
    assert w.stopped("e", True, 64.0) is None  # 2 s is not > 2
    assert w.stopped("e", True, 64.1) == "abort"
    assert w.why("e") == "stopped for 2 s while starting"
    assert w.stopped("e", False, 64.2) is None  # the abort's SIGCONT does not cancel the kill
    assert w.stopped("e", False, 64.1 + KILL_GRACE) == "kill"


def test_ready_or_a_new_epoch_clears_the_stopped_clock_and_zero_disables():
    w = HangWatchdog(timeout=2)
    w.stopped("e", True, 0.0)
    w.watch("e", 1.0)  # it became ready: heartbeats judge it from now on
    assert w.stopped("e", True, 1.5) is None and w.stopped("e", True, 3.4) is None
    w.forget("e")  # a new epoch
    assert w.stopped("e", True, 10.0) is None and w.stopped("e", True, 11.0) is None
    off = HangWatchdog(timeout=0)
    off.stopped("p", True, 0.0)
    assert off.stopped("p", True, 1e6) is None


# ------------------------------------------------------------------ bounded lines


def test_line_splitter_joins_chunks_and_caps_each_line_keeping_head_and_tail():
    s = LineSplitter(cap=100, tail=20)
    assert s.feed(b"abc") == []
    assert s.feed(b"def\nsecond") == ["abcdef"]
    huge = b"H" * 80 + b"x" * 10_000 + b"T" * 20
    out = s.feed(b" line\n" + huge[:5000]) + s.feed(huge[5000:] + b"\nlast")
    assert out[0] == "second line"
    assert out[1].startswith("H" * 80) and out[1].endswith("T" * 20)
    assert "[10000 bytes cut]" in out[1] and len(out[1]) < 100 + 40
    assert s.close() == ["last"] and s.close() == []


def test_line_splitter_survives_binary_and_carriage_returns():
    s = LineSplitter()
    assert s.feed(b"\xff\xfe ok\r\n\n") == ["\ufffd\ufffd ok", ""]


def test_shorten_keeps_head_and_tail_within_the_limit():
    text = "A" * 1000 + "B" * 100_000 + "Z" * 1000
    out = shorten(text, 4096)
    assert len(out) <= 4096 and out.startswith("A" * 1000) and out.endswith("Z" * 900)
    assert "characters cut" in out
    assert shorten("short", 10) == "short"


def test_bounded_formatter_caps_message_and_traceback():
    fmt = BoundedFormatter("%(levelname)s %(message)s")
    client_string = "m" * 100_000
    try:
        raise ValueError(f"unknown model {client_string}")
    except ValueError:
        rec = logging.LogRecord("x", logging.ERROR, __file__, 1, "loading %s on demand",
                                (client_string,), exc_info=sys.exc_info())
    out = fmt.format(rec)
    assert len(out) <= MESSAGE_CAP + TRACEBACK_CAP + 200
    assert out.startswith("ERROR loading mmm") and "Traceback" in out
    assert out.rstrip().endswith("m" * 50)  # the tail of the exception line survives
    assert all(len(line) <= 8192 for line in out.split("\n"))

# ------------------------------------------------------------------ real pipes and sockets


def test_drain_reads_a_megabyte_line_and_outlives_a_failing_callback():
    read_fd, write_fd = os.pipe()
    lines: list[str] = []

    def on_line(line: str) -> None:
        lines.append(line)
        if line == "boom":
            raise RuntimeError("forwarding failed")

    def writer() -> None:  # blocks unless the pump keeps reading
        with os.fdopen(write_fd, "wb", buffering=0) as w:
            w.write(b"boom\n" + b"x" * (4 << 20) + b"\n" + b"after\n" + b"no newline")

    t = threading.Thread(target=writer)
    t.start()
    asyncio.run(asyncio.wait_for(drain(read_fd, on_line, "test"), 30))
    t.join(5)
    assert not t.is_alive()
    assert lines[0] == "boom" and lines[2:] == ["after", "no newline"]
    assert "bytes cut" in lines[1] and len(lines[1]) < LINE_CAP + 64


def test_probe_counts_any_status_as_an_answer_and_silence_as_none(tmp_path):
    async def main() -> tuple[int | None, int | None, int | None]:
        async def answer(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            writer.close()

        hold: list = []

        async def mute(reader, writer):
            hold.append(writer)  # accepts, never answers: a wedged event loop

        ok = await asyncio.start_unix_server(answer, str(tmp_path / "a.sock"))
        wedged = await asyncio.start_server(mute, "127.0.0.1", 0)
        port = wedged.sockets[0].getsockname()[1]
        async with ok, wedged:
            a = await probe(ProbeAddress(unix=tmp_path / "a.sock"), 2.0)
            b = await probe(ProbeAddress(host="127.0.0.1", port=port), 0.3)
            c = await probe(ProbeAddress(unix=tmp_path / "nobody.sock"), 0.3)
            for w in hold:
                w.close()
        return a, b, c

    assert asyncio.run(main()) == (503, None, None)
    assert parse_status_line(b"HTTP/1.0 200 OK\r\n") == 200
    assert parse_status_line(b"SSH-2.0-OpenSSH\r\n") is None


def test_claim_unix_path_removes_a_stale_socket_and_refuses_a_live_one(tmp_path):
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()  # the file stays, nobody accepts
    claim_unix_path(stale)
    assert not stale.exists()

    live = tmp_path / "live.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(live))
    listener.listen()
    try:
        with pytest.raises(ListenError, match="another process is serving on it"):
            claim_unix_path(live)
        assert live.exists()
    finally:
        listener.close()

    plain = tmp_path / "notes.txt"
    plain.write_text("mine")
    with pytest.raises(ListenError, match="not a socket"):
        claim_unix_path(plain)
    assert plain.read_text() == "mine"
