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
from mlxd.proxy.openai_schema import (ChatRequest, Defaults, chat_messages, check_max_tokens,
                                      decode_body, sampling_params)


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
    p = sampling_params(req, Defaults(temperature=0.7, max_tokens=33), None)
    assert p.temperature == 0.7 and p.max_tokens == 33 and 0 <= p.seed < 2**63
    with pytest.raises(APIError) as e:
        sampling_params(req, Defaults(), 0)
    assert e.value.status == 400 and "at least 1" in e.value.message
    check_max_tokens(None, 100)  # the default is clamped by the engine, not refused
    check_max_tokens(100, 100)
    with pytest.raises(APIError) as e:
        check_max_tokens(101, 100)
    assert e.value.status == 400 and "context" in e.value.message


def test_chat_messages_join_text_parts_and_map_developer_role():
    req = decode_body(b'{"messages": [{"role": "developer", "content": "be brief"},'
                      b'{"role": "user", "content": [{"type": "text", "text": "a"},'
                      b'{"type": "text", "text": "b"}]}]}', ChatRequest)
    assert chat_messages(req) == [{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": "ab"}]


# ---------------------------------------------------------------- model pool, watchdog, faults

from mlxd.daemon.watchdog import KILL_GRACE, HangWatchdog  # noqa: E402
from mlxd.protocol import faults  # noqa: E402
from mlxd.proxy.model_pool import (ModelPool, NotEnoughMemory, PoolBusy,  # noqa: E402
                                   parse_keep_alive)


def test_pool_evicts_least_recently_used_idle_engine():
    p = ModelPool(size=2, idle_unload=0)
    p.add("a", 0)
    p.add("b", 1)
    p.begin("a", 5)
    p.end("a", 6, None)  # a used after b: b is the LRU
    assert p.plan_load("c", 7).evict == ["b"]
    assert p.plan_load("a", 7).evict == []  # already resident


def test_pool_never_evicts_busy_or_pinned_engines():
    p = ModelPool(size=2, idle_unload=0)
    p.add("a", 0)
    p.add("b", 1)
    p.begin("a", 2)
    p.end("b", 3, -1)  # keep_alive -1 pins b
    with pytest.raises(PoolBusy):
        p.plan_load("c", 4)
    p.end("a", 5, None)
    assert p.plan_load("c", 6).evict == ["a"]


def test_pool_evicts_more_for_memory_and_says_when_it_cannot():
    p = ModelPool(size=3, idle_unload=0)
    p.add("a", 0, weight_bytes=4 << 30)
    p.add("b", 1, weight_bytes=4 << 30)
    assert p.plan_load("c", 2, need_bytes=6 << 30, available_bytes=3 << 30).evict == ["a"]
    with pytest.raises(NotEnoughMemory):
        p.plan_load("c", 2, need_bytes=64 << 30, available_bytes=3 << 30)


def test_pool_keep_alive_and_idle_unload():
    p = ModelPool(size=3, idle_unload=10)
    p.add("a", 0)
    p.add("b", 0)
    p.add("c", 0)
    p.end("b", 0, 30)  # kept 30 s
    p.end("c", 0, -1)  # pinned
    assert p.expired(5) == []
    assert p.expired(10) == ["a"]
    assert sorted(p.expired(31)) == ["a", "b"]


@pytest.mark.parametrize("value,seconds", [(0, 0), (5, 5), ("5m", 300), ("1h", 3600),
                                           ("-1", -1), (-1, -1), ("250ms", 0.25), (None, None)])
def test_parse_keep_alive(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", True, "5 parsecs"])
def test_parse_keep_alive_rejects_junk(value):
    with pytest.raises(ValueError):
        parse_keep_alive(value)


def test_watchdog_aborts_a_busy_engine_without_progress_then_kills():
    w = HangWatchdog(timeout=5)
    w.beat("e", 10, True, 0)
    w.beat("e", 11, True, 4)  # progress moved at t=4
    assert w.check("e", 8) is None
    w.beat("e", 11, True, 9.5)
    assert w.check("e", 9.5) == "abort"
    assert w.check("e", 9.5 + KILL_GRACE - 0.1) is None
    assert w.check("e", 9.5 + KILL_GRACE) == "kill"


def test_watchdog_ignores_idle_engines_but_not_silent_ones():
    w = HangWatchdog(timeout=5)
    w.beat("e", 3, False, 0)
    w.beat("e", 3, False, 100)
    assert w.check("e", 100) is None  # idle, no progress expected
    assert w.check("e", 106) == "abort"  # no heartbeat at all for > 5 s


def test_faults_fire_at_the_nth_hit_of_the_right_epoch():
    faults.configure(1, "engine.load=fail@2#1,engine.step=fail#0")
    faults.hit("engine.step")  # epoch 0 only: nothing
    faults.hit("engine.load")  # first hit: nothing
    with pytest.raises(faults.FaultInjected):
        faults.hit("engine.load")
    faults.configure(None, "")
    faults.hit("engine.load")


# ---------------------------------------------------------------- block files

import numpy as np  # noqa: E402

from mlxd.protocol.block_format import (BadBlock, Layout, block_key,  # noqa: E402
                                              block_path, namespace_key, pack_header,
                                              read_block)
from mlxd.storage_worker.block_store import BlockStore  # noqa: E402


def _write_block(tmp_path, tokens, parent=None):
    import blake3
    lay = Layout(2, 2, 4, 4, "float32")
    ns = namespace_key("test")
    parent = parent or ns
    key = block_key(parent, tokens)
    payload = np.arange(lay.payload_bytes(len(tokens)) // 4, dtype=np.float32).tobytes()
    head = pack_header(lay, ns, parent, key, tokens, blake3.blake3(payload).digest(),
                       len(payload), False)
    store = BlockStore(tmp_path, 0)
    path = block_path(tmp_path / "ns", parent, len(tokens), key)
    store.write(path, [head, payload])
    return lay, ns, parent, key, path, payload


def test_block_round_trip_and_every_kind_of_damage(tmp_path):
    tokens = [5, 6, 7, 8]
    lay, ns, parent, key, path, payload = _write_block(tmp_path, tokens)
    assert bytes(read_block(path, lay, ns, parent, key, tokens)) == payload
    with pytest.raises(BadBlock):  # asked for other tokens
        read_block(path, lay, ns, parent, key, [5, 6, 7, 9])
    good = path.read_bytes()
    flipped = bytearray(good)
    flipped[-3] ^= 1
    path.write_bytes(bytes(flipped))
    with pytest.raises(BadBlock, match="hash"):
        read_block(path, lay, ns, parent, key, tokens)
    assert read_block(path, lay, ns, parent, key, tokens, verify=False)  # verify off: trusted
    path.write_bytes(good[:len(good) // 2])
    with pytest.raises(BadBlock, match="truncated"):
        read_block(path, lay, ns, parent, key, tokens)
    path.unlink()
    with pytest.raises(BadBlock):
        read_block(path, lay, ns, parent, key, tokens)


def test_block_store_rescan_drops_temporaries_and_evicts_leaves_first(tmp_path):
    lay, ns, parent, key, path, _ = _write_block(tmp_path, [1, 2])
    _, _, _, key2, path2, _ = _write_block(tmp_path, [3, 4], parent=key)
    (path.parent / "junk.blk.tmp").write_bytes(b"torn")
    store = BlockStore(tmp_path, cap_bytes=path.stat().st_size)
    store.scan()
    assert not list(tmp_path.rglob("*.tmp"))
    assert len(store.blocks) == 2
    assert store.evict_to_cap() == 1
    assert path.exists() and not path2.exists()  # the child went first: the chain stays whole


def test_think_splitter_separates_reasoning_from_answer():
    from mlxd.engine.output import ThinkSplitter
    s = ThinkSplitter(prefilled=False)
    got = [s.feed(x, False) for x in ["<thi", "nk>abc", "def</th", "ink>\n\nAns", "wer"]]
    got.append(s.feed("", True))
    assert "".join(r for r, _ in got) == "abcdef" and "".join(a for _, a in got) == "Answer"
    assert got[0] == ("", "")  # a partial tag is held back, not sent as answer
    pre = ThinkSplitter(prefilled=True)  # the template opened <think> in the prompt
    assert pre.feed("x</think>y", False) == ("x", "y")
    plain = ThinkSplitter(prefilled=False)  # a model that does not think this time
    assert plain.feed(" ", False) == ("", "")
    assert plain.feed("Hello", False) == ("", " Hello")


TOOL_TEMPLATE = (  # a json_tools-style template: mlx-lm infers its tool parser from it
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% if message.tool_calls %}"
    "{% for tool_call in message.tool_calls %}<tool_call>{{ tool_call.name }}</tool_call>"
    "{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_tool_calls_are_cut_out_of_the_answer(tmp_path):
    """The engine's output path with mlx-lm's own parser for the model's format."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxd.engine.output import RequestOutput, ToolCallSplitter
    from mlxd.engine.random_model import write_random_model
    tok = load_tokenizer(write_random_model(tmp_path / "m", chat_template=TOOL_TEMPLATE))
    assert tok.has_tool_calling and tok.tool_call_start == "<tool_call>"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    out = RequestOutput("r", tok.detokenizer, [], frozenset(tok.eos_token_ids), 3,
                        tool_splitter=ToolCallSplitter(tok.tool_call_start, tok.tool_call_end,
                                                       tok.tool_parser, tools))
    text = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>')
    ids = tok.encode(text, add_special_tokens=False)
    deltas = [out.add(t, None) for t in ids[:-1]] + [out.add(ids[-1], "stop")]
    deltas = [d for d in deltas if d is not None]
    assert "".join(d.text for d in deltas) == "Checking."
    calls = [c for d in deltas for c in (d.tool_calls or [])]
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert deltas[-1].finish_reason == "stop"
    assert out.completion_tokens == len(ids)  # every token still counted
