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
