"""The engine's output path (engine/output.py), without processes: stop strings held back and
cut, EOS, reasoning split from the answer, tool calls cut out with mlx-lm's own parser."""

from __future__ import annotations

from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxd.engine.wire.output import RequestOutput, ThinkSplitter, ToolCallSplitter, stop_hold_length
from mlxd.protocol.messages import Delta
from support.random_model import write_random_model


class CharDetokenizer:
    """A detokenizer over a fixed table, with the interface of mlx-lm's."""

    def __init__(self, table):
        self.table, self.text = table, ""

    def add_token(self, t):
        self.text += self.table[t]

    def finalize(self):
        pass


def run(pieces, stops, finish_last="length") -> list[Delta]:
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
    assert d is not None
    assert d.finish_reason == "stop" and d.text == "" and d.token_ids == []
    assert d.completion_tokens == 1


def test_think_splitter_separates_reasoning_from_answer():
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
    tok = load_tokenizer(write_random_model(tmp_path / "m", chat_template=TOOL_TEMPLATE))
    assert tok.has_tool_calling and tok.tool_call_start == "<tool_call>"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    out = RequestOutput("r", tok.detokenizer, [], frozenset(tok.eos_token_ids), 3,
                        tool_splitter=ToolCallSplitter(tok.tool_call_start, tok.tool_call_end,
                                                       tok.tool_parser, tools))
    text = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>')
    ids = tok.encode(text, add_special_tokens=False)
    added = [out.add(t, None) for t in ids[:-1]] + [out.add(ids[-1], "stop")]
    deltas = [d for d in added if d is not None]
    assert "".join(d.text for d in deltas) == "Checking."
    calls = [c for d in deltas for c in (d.tool_calls or [])]
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert deltas[-1].finish_reason == "stop"
    assert out.completion_tokens == len(ids)  # every token still counted


def _stopped_output_thread(tmp_path, unread: bool) -> float:
    """An engine's output thread whose proxy is gone (nothing binds its endpoint) sends its
    last status and stops; the seconds its ZeroMQ context then takes to terminate."""
    import os
    import threading
    import time

    import zmq

    from mlxd.engine.state import Channels, StatusTick
    from mlxd.engine.wire.output_thread import OutputThread
    from mlxd.protocol.messages import EngineStatus
    ctx = zmq.Context()
    ch = Channels()
    status = EngineStatus("e", 0, os.getpid(), "m", ["m"], "ready")
    out = OutputThread(ctx, f"ipc://{tmp_path}/outputs-{int(unread)}", "e", 0, ch,
                       lambda: status, lambda _: None, lambda _: "")
    thread = threading.Thread(target=out.run)
    thread.start()
    if unread:
        ch.outputs_unread.set()
    ch.stop.set()
    ch.outq.put(StatusTick())
    thread.join(10)
    assert not thread.is_alive()
    t0 = time.monotonic()
    ctx.term()  # what the engine process does last
    return time.monotonic() - t0


def test_an_engine_told_its_outputs_are_unread_exits_without_lingering(tmp_path):
    """Stopping a daemon stops its proxy first: an engine told so (Shutdown.outputs_unread)
    closes its output socket at once, where it would otherwise wait its one-second linger to
    deliver a last status nobody reads (a second of every engine's stop)."""
    assert _stopped_output_thread(tmp_path, unread=False) >= 0.9  # the linger, waited out
    assert _stopped_output_thread(tmp_path, unread=True) < 0.5
