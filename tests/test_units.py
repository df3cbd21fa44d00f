"""Pure logic, tested without processes: stop strings, restart policy, codecs, request schema."""

from __future__ import annotations

import random

import msgspec
import pytest

from mlxd.daemon.restart_policy import RestartPolicy
from mlxd.engine.output import RequestOutput, stop_hold_length
from mlxd.protocol import codec, exit_codes
from mlxd.protocol.messages import Delta, EngineStatus, Generate, SamplingParams, StepOutput
from mlxd.proxy.errors import APIError
from mlxd.proxy.openai_schema import (ChatRequest, Defaults, chat_messages, decode_body,
                                      sampling_params)


class CharDetokenizer:
    """A detokenizer over a fixed table, with the interface of mlx-lm's."""

    def __init__(self, table):
        self.table, self.text = table, ""

    def add_token(self, t):
        self.text += self.table[t]

    def finalize(self):
        pass


def run(pieces, stops, finish_last="length"):
    table = {i: p for i, p in enumerate(pieces)}
    out = RequestOutput("r", CharDetokenizer(table), stops, frozenset({999}), prompt_tokens=3)
    deltas = []
    for i in range(len(pieces)):
        d = out.add(i, finish_last if i == len(pieces) - 1 else None)
        if d is not None:
            deltas.append(d)
        if out.finished:
            break
    return deltas


def test_stop_hold_length():
    assert stop_hold_length("hello wor", ["world"]) == 3
    assert stop_hold_length("hello", ["xyz"]) == 0
    assert stop_hold_length("ab", ["b", "abc"]) == 2


def test_stop_string_split_across_tokens_is_never_emitted():
    deltas = run(["Hel", "lo, ST", "OP and more"], ["STOP"])
    assert "".join(d.text for d in deltas) == "Hello, "
    assert deltas[-1].finish_reason == "stop"
    assert deltas[-1].completion_tokens == 3


def test_text_held_back_for_a_possible_stop_is_released():
    deltas = run(["a S", "T", "x", "y"], ["STOP"])
    assert "".join(d.text for d in deltas) == "a STxy"
    assert deltas[1].text == ""  # "ST" still held
    assert deltas[-1].finish_reason == "length"


def test_eos_is_not_text_and_not_counted():
    table = {0: "hi", 999: "<eos>"}
    out = RequestOutput("r", CharDetokenizer(table), [], frozenset({999}), 1)
    out.add(0, None)
    d = out.add(999, "stop")
    assert d.finish_reason == "stop" and d.text == "" and d.token_ids == []
    assert d.completion_tokens == 1


def test_restart_policy_backs_off_then_breaks_a_crash_loop():
    p = RestartPolicy(base_delay=1, max_delay=8, jitter=0, loop_crashes=4, loop_window=60)
    delays = [p.after_exit(1, t)[1] for t in (0, 1, 2)]
    assert delays == [1, 2, 4]
    assert p.after_exit(1, 3) == ("failed", 0.0)
    p.reset()
    assert p.after_exit(-9, 100)[0] == "restart"


def test_restart_policy_forgets_old_crashes_and_never_retries_config_errors():
    p = RestartPolicy(base_delay=1, jitter=0.2, loop_crashes=3, loop_window=10)
    for t in (0, 20, 40, 60):
        verdict, delay = p.after_exit(1, t, random.Random(t))
        assert verdict == "restart" and 0.8 <= delay <= 1.2
    assert p.after_exit(exit_codes.CONFIG_ERROR, 61) == ("failed", 0.0)


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


def test_sampling_params_defaults_and_limits():
    req = decode_body(b'{"messages": [{"role": "user", "content": "x"}]}', ChatRequest)
    p = sampling_params(req, Defaults(temperature=0.7, max_tokens=33), None, 100)
    assert p.temperature == 0.7 and p.max_tokens == 33 and 0 <= p.seed < 2**63
    with pytest.raises(APIError) as e:
        sampling_params(req, Defaults(), 101, 100)
    assert e.value.status == 400 and "context" in e.value.message


def test_chat_messages_join_text_parts_and_map_developer_role():
    req = decode_body(b'{"messages": [{"role": "developer", "content": "be brief"},'
                      b'{"role": "user", "content": [{"type": "text", "text": "a"},'
                      b'{"type": "text", "text": "b"}]}]}', ChatRequest)
    assert chat_messages(req) == [{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": "ab"}]
