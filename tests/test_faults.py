"""Fault injection points (protocol/faults.py)."""

from __future__ import annotations

import pytest

from mlxd.protocol import faults


def test_faults_fire_at_the_nth_hit_of_the_right_epoch():
    faults.configure(1, "engine.load=fail@2#1,engine.step=fail#0")
    faults.hit("engine.step")  # epoch 0 only: nothing
    faults.hit("engine.load")  # first hit: nothing
    with pytest.raises(faults.FaultInjected):
        faults.hit("engine.load")
    faults.configure(None, "")
    faults.hit("engine.load")


def test_delay_ms_sleeps_that_long_at_every_hit_from_the_nth():
    import time
    faults.configure(0, "engine.vision.encode=delay:120@2")
    try:
        t0 = time.monotonic()
        faults.hit("engine.vision.encode")  # before the nth: no sleep
        t1 = time.monotonic()
        faults.hit("engine.vision.encode")
        faults.hit("engine.vision.encode")
        t2 = time.monotonic()
        assert t1 - t0 < 0.1 <= 0.24 <= t2 - t1
        with pytest.raises(ValueError, match="whole milliseconds"):
            faults.configure(0, "engine.step=delay:soon")
    finally:
        faults.configure(None, "")
