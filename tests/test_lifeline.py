"""The lifeline pipe: a child started with it exits (79) as soon as its parent dies, even by
SIGKILL and even while the child is busy, and a child started without it is unaffected."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil

from mlxd.protocol import exit_codes

CHILD = textwrap.dedent("""
    import sys, time
    from mlxd.protocol.lifeline import follow_parent
    follow_parent(int(sys.argv[1]))  # the fd a launch struct would name
    print("ready", flush=True)
    while True:  # busy in Python, as an engine's threads are: the watcher still runs
        sum(range(10000))
""")

PARENT = textwrap.dedent("""
    import asyncio, os, sys
    from mlxd.protocol.lifeline import Lifeline
    async def main():
        line = Lifeline()
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", sys.argv[1], str(line.read_fd), stdout=asyncio.subprocess.PIPE,
            **line.spawn_kwargs(dict(os.environ)))
        assert (await child.stdout.readline()).strip() == b"ready"
        print(child.pid, flush=True)
        await asyncio.sleep(3600)
    asyncio.run(main())
""")


def test_child_exits_79_at_once_when_its_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        # reparented, the child cannot be waited on here; its exit code is the next test's
        _, alive = psutil.wait_procs([child], timeout=5)
        assert not alive, "the child outlived its parent by 5 s"
    finally:
        parent.kill()
        parent.wait()


def test_exit_code_is_parent_gone():
    """Run the child under this test as its parent and close the write end by hand."""
    r, w = os.pipe()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(r)], stdout=subprocess.PIPE,
                             pass_fds=(r,))
    os.close(r)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        assert child.poll() is None
        os.close(w)
        assert child.wait(timeout=5) == exit_codes.PARENT_GONE
    finally:
        child.kill()
        child.wait()


def test_without_a_lifeline_the_child_does_not_watch():
    code = ("from mlxd.protocol.lifeline import follow_parent; import threading; "
            "follow_parent(None); print(sorted(t.name for t in threading.enumerate()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert "lifeline" not in out.stdout
