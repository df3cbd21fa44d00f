"""The wire codecs (protocol/codec.py): messages round-trip, garbage is refused."""

from __future__ import annotations

import msgspec
import pytest

from mlxd.protocol import codec
from mlxd.protocol.messages import Delta, EngineStatus, Generate, SamplingParams, StepOutput


def test_codecs_round_trip_and_reject_garbage():
    to_engine, from_engine = codec.to_engine(), codec.from_engine()
    g = Generate("r1", SamplingParams(temperature=0.5, stop=["x"]), messages=[{"role": "user",
                                                                              "content": "hi"}])
    assert to_engine.decode(to_engine.encode(g)) == g
    s = StepOutput("m0", 3, [Delta("r1", "hé", [5, 6], None, 2, 2)])
    assert from_engine.decode(from_engine.encode(s)) == s
    st = EngineStatus("m0", 1, 42, "tiny", ["tiny"], "ready")
    assert from_engine.decode(from_engine.encode(st)) == st
    with pytest.raises(msgspec.DecodeError):
        from_engine.decode(b"\x93garbage")
