"""A signal at the end of a process's event loop (`protocol/signals.py`): asyncio closes its
self-pipe before it removes its signal handlers, and a SIGTERM between the two (the
supervisor's, just after a process group's) was printed as a BrokenPipeError traceback in the
proxy's log. Handed to SIG_IGN before the loop closes, it is silent and harmless."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import asyncio, os, signal, sys
    from mlxd.protocol.signals import ignore_from_now
    loop = asyncio.new_event_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: None)
    close_pipe = loop._close_self_pipe
    def close_then_signal():  # the window: the self-pipe shut, the handler not yet removed
        close_pipe()
        os.kill(os.getpid(), signal.SIGTERM)
    loop._close_self_pipe = close_then_signal
    if sys.argv[1] == "ignore":
        ignore_from_now(loop, [signal.SIGTERM])
    loop.close()
    os.kill(os.getpid(), signal.SIGTERM)  # and one after the loop is gone
    print("alive", flush=True)
""")


def run_child(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                          timeout=60)


def test_a_signal_while_the_loop_closes_is_ignored_without_a_traceback():
    done = run_child("ignore")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "alive"
    assert done.stderr == ""


def test_without_the_hand_over_the_same_signal_prints_the_failed_write():
    """The test above can fail: the same child, left to asyncio's own close, prints the
    traceback the proxy's log showed, and the late signal kills it."""
    done = run_child("asyncio")
    assert "Exception ignored when trying to write to the signal wakeup fd" in done.stderr
    assert "alive" not in done.stdout and done.returncode != 0
