"""A burst's chat prompts tokenized in one call (engine/prompt_batch.py) and the admission
lane that hands them over together (engine/admission_lanes.py): the same tokens as one at a
time, and each request its own answer when one of them is bad. Real tokenizer, real threads,
no processes."""

from __future__ import annotations

import queue
import threading

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxd.engine.admit import prepare as admission
from mlxd.engine.admit import prompt_batch
from mlxd.engine.admit.lanes import AdmissionLanes
from mlxd.engine.admit.prepare import Admitted, Answered
from mlxd.engine.state import LoadedModel
from mlxd.protocol.messages import Delta, Generate, SamplingParams


@pytest.fixture(scope="module")
def model(tiny_model) -> LoadedModel:
    tok = load_tokenizer(tiny_model)
    return LoadedModel(tok, 256, frozenset(tok.eos_token_ids), admission.max_token_bytes(tok),
                       None)


def chat(rid: str, *turns: tuple[str, object], **kw) -> Generate:
    return Generate(rid, SamplingParams(), messages=[{"role": r, "content": c}
                                                      for r, c in turns], **kw)


def test_batched_tokens_are_the_per_request_tokens(model):
    msgs = [chat("a", ("user", "Hello, how are you today?")),
            chat("b", ("system", "Be brief."), ("user", "What is the capital of France?")),
            chat("c", ("user", "Write code."), ("assistant", "def main():")),  # prefill
            chat("d", ("user", "Numbers: 0 1 2"), ("assistant", "3 4")),  # prefill
            chat("e", ("user", "no new turn"), add_generation_prompt=False),
            chat("f", ("user", "The quick brown fox")),
            chat("t", ("user", "weather?"), tools=[{"type": "function", "function": {
                "name": "w", "parameters": {}}}]),  # tools: on its own
            Generate("p", SamplingParams(), prompt="a completion prompt"),
            Generate("i", SamplingParams(), prompt_token_ids=[1, 2, 3])]
    got = prompt_batch.chat_tokens(msgs, model)
    one_by_one = [admission.prompt_tokens(model.tokenizer, m) for m in msgs]
    # a, b, f share their flags; c and d (assistant prefill) theirs; e is alone
    assert [g is not None for g in got] == [True, True, True, True, False, True, False,
                                            False, False]
    for g, want in zip(got, one_by_one, strict=True):
        assert g is None or g == want
    assert got[2] != one_by_one[3]  # not one answer for all


def test_a_conversation_the_template_rejects_sends_its_group_back_to_one_at_a_time(model):
    """The batch call fails as a whole; each request then gets its own verdict: the bad one
    a client error, the others their tokens."""
    msgs = [chat("ok1", ("user", "Hello")), chat("bad", ("user", ["not", "text"])),
            chat("ok2", ("user", "Paris"))]
    assert prompt_batch.chat_tokens(msgs, model) == [None, None, None]
    results = [admission.prepare(m, model, lambda p: None, 0.0) for m in msgs]
    assert [type(r) for r in results] == [Admitted, Answered, Admitted]
    bad = results[1]
    assert isinstance(bad, Answered) and bad.deltas[0].error_code == "invalid_messages"


def test_a_prompt_over_the_size_check_is_left_to_its_own_answer(model):
    huge = "x" * (256 * model.max_token_bytes * 4 + 1)
    msgs = [chat("a", ("user", "Hello")), chat("huge", ("user", huge)), chat("b", ("user", "Hi"))]
    got = prompt_batch.chat_tokens(msgs, model)
    assert got[1] is None and got[0] is not None and got[2] is not None
    result = admission.prepare(msgs[1], model, lambda p: None, 0.0)
    assert isinstance(result, Answered)
    assert result.deltas[0].error_code == "context_length_exceeded"


class Batches:
    """prepare() of the first request blocks until released; prepare_many() records the
    requests it was given together."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started: queue.Queue[str] = queue.Queue()
        self.batches: list[list[str]] = []
        self.events: queue.Queue[tuple[str, str]] = queue.Queue()

    def prepare(self, msg: Generate) -> Answered:
        self.started.put(msg.request_id)
        assert self.release.wait(10)
        return Answered([Delta(msg.request_id)])

    def prepare_many(self, msgs: list[Generate]):
        self.batches.append([m.request_id for m in msgs])
        for m in msgs:
            yield Answered([Delta(m.request_id)])

    def deliver(self, result: Admitted | Answered) -> None:
        assert isinstance(result, Answered)  # prepare() and prepare_many() answer each
        self.events.put(("delivered", result.deltas[0].request_id))

    def dropped(self, msg: Generate) -> None:
        self.events.put(("dropped", msg.request_id))


def test_requests_waiting_behind_a_busy_lane_are_taken_and_prepared_together():
    b = Batches()
    lanes = AdmissionLanes(b.prepare, b.deliver, b.dropped, small_threads=1,
                           prepare_many=b.prepare_many)
    try:
        lanes.submit(chat("first", ("user", "x")))
        assert b.started.get(timeout=10) == "first"  # the lane's only thread is busy with it
        for rid in ("w1", "w2", "gone", "w3"):
            lanes.submit(chat(rid, ("user", "x")))
        lanes.cancel(["gone"])
        assert lanes.preparing() == 5
        b.release.set()
        events = [b.events.get(timeout=10) for _ in range(5)]
        assert events == [("delivered", "first"), ("delivered", "w1"), ("delivered", "w2"),
                          ("dropped", "gone"), ("delivered", "w3")]
        assert b.batches == [["w1", "w2", "w3"]]  # the cancelled one never prepared
        assert lanes.preparing() == 0
    finally:
        b.release.set()
        lanes.stop()


def test_stop_ends_every_lane_thread_even_when_one_drains_the_others_stop():
    """A thread that finds another thread's stop while gathering a batch leaves it there."""
    b = Batches()
    before = set(threading.enumerate())
    lanes = AdmissionLanes(b.prepare, b.deliver, b.dropped, small_threads=2,
                           prepare_many=b.prepare_many)
    threads = [t for t in threading.enumerate() if t not in before]
    assert len(threads) == 3  # two small, one large
    for rid in ("first", "second"):  # each thread busy with one
        lanes.submit(chat(rid, ("user", "x")))
        assert b.started.get(timeout=10) == rid
    lanes.submit(chat("q1", ("user", "x")))
    lanes.submit(chat("q2", ("user", "x")))
    lanes.stop()  # both small threads' stops queue up behind q1 and q2
    b.release.set()
    for t in threads:
        t.join(10)
        assert not t.is_alive(), t.name
    assert {b.events.get(timeout=10) for _ in range(4)} == {
        ("delivered", r) for r in ("first", "second", "q1", "q2")}
    assert b.batches == [["q1", "q2"]]


def test_a_preparation_that_raises_costs_only_its_request_never_the_lane():
    """prepare_many() fails after its first result: the rest are prepared one at a time, the
    failing one again; one that fails on its own too is dropped (its client answered), and
    the lane thread goes on serving."""
    events: queue.Queue[tuple[str, str]] = queue.Queue()
    gate = threading.Event()
    started = threading.Event()

    def prepare(msg: Generate) -> Answered:
        if msg.request_id == "first":
            started.set()
            assert gate.wait(10)
        if msg.request_id == "bad":
            raise RuntimeError("a bug, not the client's")
        return Answered([Delta(msg.request_id)])

    def prepare_many(msgs: list[Generate]):
        yield Answered([Delta(msgs[0].request_id)])
        raise RuntimeError("the batch step broke")

    def deliver(result: Admitted | Answered) -> None:
        assert isinstance(result, Answered)
        events.put(("delivered", result.deltas[0].request_id))

    lanes = AdmissionLanes(prepare, deliver, lambda m: events.put(("dropped", m.request_id)),
                           small_threads=1, prepare_many=prepare_many)
    try:
        lanes.submit(chat("first", ("user", "x")))
        assert started.wait(10)
        for rid in ("w1", "bad", "w2"):
            lanes.submit(chat(rid, ("user", "x")))
        gate.set()
        assert [events.get(timeout=10) for _ in range(4)] == [
            ("delivered", "first"), ("delivered", "w1"), ("dropped", "bad"),
            ("delivered", "w2")]
        lanes.submit(chat("later", ("user", "x")))
        assert events.get(timeout=10) == ("delivered", "later")
        assert lanes.preparing() == 0
    finally:
        gate.set()
        lanes.stop()


def test_the_lane_thread_count_setting():
    from mlxd.engine.admit.lanes import small_lane_threads
    default = small_lane_threads(0)  # the setting's default: up to four
    assert 1 <= default <= 4
    assert small_lane_threads(2) == 2
