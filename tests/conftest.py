from __future__ import annotations

from pathlib import Path

import pytest

from support.harness import SHARED_INDEX, Daemon, leftovers
from support.random_model import write_random_model


@pytest.fixture(scope="session", autouse=True)
def shared_transformers_index(tmp_path_factory):
    """Daemons on cache dirs of their own share one transformers import index a session."""
    SHARED_INDEX.append(tmp_path_factory.mktemp("transformers-index"))
    yield
    SHARED_INDEX.clear()


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    """The whole suite leaves no process and no shared-memory segment of a daemon behind."""
    yield
    segments, procs, sockets = leftovers()
    assert not procs, f"daemon processes outlived the tests: {procs}"
    assert not segments, f"shared memory left: {segments}"
    assert not sockets, f"sockets left: {sockets}"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("models") / "tiny-llama", context=256)


@pytest.fixture(scope="session")
def tiny_model_b(tmp_path_factory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("models") / "tiny-llama-b", seed=1)


@pytest.fixture(scope="session")
def tiny_model_c(tmp_path_factory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("models") / "tiny-llama-c", seed=2)


def start_daemon(model, *extra, isolate=False, **kw) -> Daemon:
    d = Daemon(str(model) if model is not None else None, *extra, isolate=isolate, **kw)
    try:
        d.start()
    except BaseException:
        d.cleanup()
        raise
    return d


def stop_and_check(d: Daemon) -> None:
    """Stop a daemon with SIGTERM: it exits 0, every child of it exited cleanly too, and it
    leaves no process, socket or segment."""
    try:
        assert d.stop() == 0, d.log()
        assert "while stopping" not in d.log(), d.log()
        d.assert_clean()
    finally:
        d.cleanup()


@pytest.fixture(scope="module", params=["inprocess", "isolate"])
def daemon(request, tiny_model):
    d = start_daemon(tiny_model, "--batch", "8", isolate=request.param == "isolate")
    yield d
    try:
        code = d.stop()
        assert code == 0, d.log()
        d.assert_clean()
    finally:
        d.cleanup()
