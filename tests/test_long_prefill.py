"""A prefill longer than `--hang-timeout` is progress, not a hang: the engine keeps each step
(one prefill chunk) well inside the timeout (engine/batch/timing/chunking.py), so the watchdog never
kills a working engine, and running streams keep getting tokens between chunks. While a prompt
prefills, its stream sends keep-alives (`--stream-ping`): SSE comments on OpenAI routes,
`ping` events on /v1/messages, which the official SDKs pass over."""

from __future__ import annotations

import queue
import time

import httpx
from mlx_lm.sample_utils import greedy_sampler

from conftest import start_daemon
from conftest import stop_and_check as stop
from mlxd.engine.batch.timing.chunking import FLOOR, IDLE_STEP, START, PrefillChunks, step_target
from mlxd.engine.batch.timing.pace import PassPace, StepPace, attention_growth
from support.random_model import write_random_model


def test_the_chunk_follows_the_step_time_within_its_bounds():
    chunks = PrefillChunks(512, step_target(2.0))  # a 0.5 s target
    assert chunks.chunk == 64  # before any step is timed
    assert chunks.observe(64, 0.01) == 128  # fast: grows, at most 2x a step
    assert chunks.observe(128, 0.01) == 256 and chunks.observe(256, 0.01) == 512
    assert chunks.for_step(decoding=True) == 512 and chunks.for_step(decoding=False) == 512
    # with no row decoding, nothing waits between tokens: up to mlx-lm's own chunk
    assert chunks.observe(512, 0.001) == 1024 and chunks.observe(1024, 0.001) == IDLE_STEP
    assert chunks.observe(2048, 0.001) == IDLE_STEP  # never past it
    assert chunks.for_step(decoding=True) == 512  # never past --prefill-step while rows decode
    assert chunks.for_step(decoding=False) == IDLE_STEP
    # a burst shares it: no prompt's chunk below --prefill-step, the step no larger than before
    assert chunks.for_step(decoding=False, prompts=2) == IDLE_STEP // 2
    assert chunks.for_step(decoding=False, prompts=32) == 512
    assert chunks.observe(512, 4.0) == 51  # 128 tok/s: 64 fit in 0.5 s, 51 with the margin
    assert chunks.for_step(decoding=True) == chunks.for_step(decoding=False) == 51
    assert chunks.observe(64, 10.0) == FLOOR  # never below the floor
    assert step_target(0) == 2.0 and step_target(60) == 2.0 and step_target(2) == 0.5
    assert PrefillChunks(4096, 0.5).most == 4096  # a larger --prefill-step is its own bound


def test_the_first_chunk_follows_the_warm_ups_rate_and_the_pace_covers_the_step_running():
    """Before any step is timed, the warm-up's seconds per prompt token size the first chunk
    (no smaller than the floor) and the pace the engine reports while it runs; afterwards the
    longer of the last step and what the next should take."""
    assert PrefillChunks(512, 2.0, token_s=0.001).chunk == START  # a fast device: START fits
    assert PrefillChunks(512, 2.0, token_s=0.02).chunk == START  # 80 fit: START still bounds
    slow = PrefillChunks(512, 0.25, token_s=0.13)  # this CPU's default model, a 1 s timeout
    assert slow.chunk == FLOOR  # 64 tokens would take 8 s
    assert PrefillChunks(512, 2.0, token_s=0.05).chunk == 32  # 2 s x 0.8 / 0.05 s
    pace = StepPace(token_s=0.13)
    assert pace.starting(16) == 16 * 0.13  # the first step: the warm-up's rate
    assert pace.starting(0) == 0.0  # nothing to prefill, no step timed yet
    pace.ended(2.5, 16)  # a prefill step: 0.156 s a token
    assert pace.starting(32) == 32 * 2.5 / 16  # a longer chunk next: its expected time
    assert pace.starting(8) == 2.5  # a shorter one: no less than the step just seen
    pace.ended(0.2, 0)  # a decode step teaches no token rate
    assert pace.starting(0) == 0.2 and pace.token_s == 2.5 / 16
    assert StepPace().starting(64) == 0.0  # no warm-up figure: the timeout alone


def test_a_whole_pass_is_paced_for_its_length_and_errs_long():
    """An embedding pass cannot be chunked: its pace is its padded tokens at the last seen
    rate, stretched by how much longer its inputs are than those that set the rate. Against
    the cost a transformer's arithmetic gives (per token: the weights, plus attention that
    grows with the length, crossing them at several times the hidden size) it errs long."""
    width = 576  # SmolLM2-135M's hidden size
    pace = PassPace(width, token_s=0.147)  # this CPU: 147 ms a token, measured at 64 tokens

    def cost(padded: int, longest: int) -> float:  # the truth: attention equals weights at 6 x
        return padded * 0.147 * (1 + longest / (6 * width)) / (1 + 64 / (6 * width))

    for longest in (64, 512, 1024, 8192):
        expected = pace.starting_pass(2 * longest, longest)
        assert cost(2 * longest, longest) <= expected <= 16 * cost(2 * longest, longest)
    assert pace.starting_pass(8192, 8192) > 8192 * 0.147 * 10  # 8k tokens: much longer a token
    pace.ended_pass(200.0, 1024, 1024)  # measured: now the rate at 1,024 tokens
    assert pace.seen == 1024 and pace.token_s == 200.0 / 1024
    assert pace.starting_pass(512, 256) == 200.0  # shorter: no less than the pass just seen
    assert pace.starting_pass(4096, 2048) == 4096 * 200.0 / 1024 * attention_growth(2048, 1024,
                                                                                     width)
    assert attention_growth(100, 1000, width) == 1.0  # never shrinks below the rate seen
    assert PassPace(width).starting_pass(4096, 4096) == 0.0  # no figure: the timeout alone


def test_a_step_prefills_mlx_lms_chunk_alone_and_prefill_step_while_a_row_decodes(tmp_path):
    """Nothing waits between tokens when no row decodes: a step then prefills up to mlx-lm's
    own chunk (an agent's next turn costs as few steps as in-process); while a row decodes,
    `--prefill-step` bounds what it waits."""
    from mlxd.engine.batch.messages import AddRequest, StepTokens
    from mlxd.engine.batch.runner import Runner
    from mlxd.engine.load.loader import load_model
    from support.runner_drive import run_one
    model = write_random_model(tmp_path / "m", context=8192)
    m, _, _ = load_model(str(model), tmp_path / "c")
    outq: queue.Queue = queue.Queue()
    # a target no step reaches on this CPU: the chunk's size rule alone (its time rule: above)
    runner = Runner(m, [], batch_size=2, prefill_step=128, outbox=outq, cache_bytes=0,
                    step_target_s=600.0)

    def prompt(k: int, n: int) -> list[int]:
        return [5 + (i * k) % 400 for i in range(n)]

    def add(rid: str, tokens: list[int], n: int) -> AddRequest:
        return AddRequest(rid, tokens, n, greedy_sampler, [])

    run_one(runner, outq, add("warm", prompt(37, 2100), 2))  # the chunk grows from START
    before = runner.counters.steps
    run_one(runner, outq, add("alone", prompt(41, 1024), 1))
    alone = runner.counters.steps - before

    runner.inbox.put(add("decoding", prompt(43, 16), 10_000))
    runner.take_commands()
    while not any(isinstance(x, StepTokens) for x in iter_queue(outq)):
        runner.step()
    runner.inbox.put(add("beside", prompt(47, 1024), 1))
    runner.take_commands()
    before = runner.counters.steps
    while not any(isinstance(x, StepTokens) and any(r[0] == "beside" for r in x.rows)
                  for x in iter_queue(outq)):
        runner.step()
    beside = runner.counters.steps - before
    assert alone <= 3, alone  # 1,023 tokens in one chunk, then the first token
    assert beside >= 8, beside  # 128 a step: the decoding row waits one chunk per token


def test_a_steps_chunk_is_one_forward_pass_whatever_the_generator_was_made_with(
        tmp_path, monkeypatch):
    """The chunk a step prefills runs in one forward pass, as in-process mlx-lm runs its
    2,048: mlx-lm's prompt batch keeps the pass size the generator was made with
    (`--prefill-step`, 128 here), and the runner's larger idle chunk ran as passes of that
    size (issue 33: four passes a step, each a new attention shape over the whole context)."""
    from mlxd.engine.batch.messages import AddRequest
    from mlxd.engine.batch.runner import Runner
    from mlxd.engine.load.loader import load_model
    from support.runner_drive import run_one
    model = write_random_model(tmp_path / "m", context=8192)
    m, _, _ = load_model(str(model), tmp_path / "c")
    outq: queue.Queue = queue.Queue()
    runner = Runner(m, [], batch_size=2, prefill_step=128, outbox=outq, cache_bytes=0,
                    step_target_s=600.0)
    passes: list[int] = []  # each forward pass's query tokens
    call = type(m).__call__

    def counted(self, inputs, *a, **k):
        passes.append(int(inputs.shape[1]))
        return call(self, inputs, *a, **k)
    monkeypatch.setattr(type(m), "__call__", counted)

    def add(rid: str, n: int) -> AddRequest:
        return AddRequest(rid, [5 + (i * 41) % 400 for i in range(n)], 1, greedy_sampler, [])

    run_one(runner, outq, add("warm", 2100))  # the chunk grows from START to IDLE_STEP
    passes.clear()
    run_one(runner, outq, add("alone", 1024))
    prefill = [n for n in passes if n > 1]
    # one pass of all but the last token, then the first token (a chunk this long is not
    # folded: `last_token_fold.chunk_limit`)
    assert prefill == [1023], passes


def test_prompts_over_a_long_context_prefill_one_at_a_time_with_prefill_alone_from(
        tmp_path, monkeypatch):
    """The hidden setting `prefill_alone_from`: two prompts admitted together, each over a
    context of at least that many tokens, prefill one after the other (single-row passes),
    not in one padded batch (the default from 8,192 tokens); off (0), mlx-lm batches them."""
    from mlxd.engine.batch.messages import AddRequest, StepTokens
    from mlxd.engine.batch.runner import Runner
    from mlxd.engine.load.loader import load_model
    from mlxd.protocol.settings import TuningSettings
    model = write_random_model(tmp_path / "m", context=8192)
    m, _, _ = load_model(str(model), tmp_path / "c")
    rows: list[int] = []  # each prefill pass's rows
    call = type(m).__call__

    def counted(self, inputs, *a, **k):
        if inputs.shape[1] > 1:
            rows.append(int(inputs.shape[0]))
        return call(self, inputs, *a, **k)
    monkeypatch.setattr(type(m), "__call__", counted)

    def passes(alone_from: int) -> list[int]:
        outq: queue.Queue = queue.Queue()
        runner = Runner(m, [], batch_size=2, prefill_step=128, outbox=outq, cache_bytes=0,
                        step_target_s=600.0, tuning=TuningSettings(prefill_alone_from=alone_from))
        for k, n in ((41, 300), (43, 260)):
            runner.inbox.put(AddRequest(f"r{k}", [5 + (i * k) % 400 for i in range(n)], 2,
                                        greedy_sampler, []))
        runner.take_commands()
        rows.clear()
        done: set[str] = set()
        while len(done) < 2:
            runner.step()
            for x in iter_queue(outq):
                if isinstance(x, StepTokens):
                    done |= {rid for rid, _, fin in x.rows if fin}
        return list(rows)

    assert max(passes(0)) == 2  # mlx-lm's batching: the two prompts in one padded pass
    alone = passes(256)
    assert alone and max(alone) == 1, alone


def test_long_prompts_prefill_apart_and_short_ones_join_at_once():
    """`prefill_apart.plan`: no long context, mlx-lm's batching; at most one long prompt in the
    prompt batch; short waiting prompts go ahead and join whatever is being prefilled."""
    from mlxd.engine.batch.prefill_apart import plan
    assert plan([100], [200, 50], 8192, 16) == ([0, 1], 16)  # nothing long
    assert plan([], [9000, 9500], 8192, 16) == ([0, 1], 1)  # the first long one starts alone
    assert plan([9000], [9500, 300, 40], 8192, 16) == ([1, 2, 0], 3)  # shorts join, long waits
    assert plan([300], [9500, 9000, 40], 8192, 16) == ([2, 0, 1], 3)  # one long may join shorts
    assert plan([9000], [9500], 8192, 16) == ([0], 1)
    assert plan([9000], [100] * 40, 8192, 16) == (list(range(40)), 16)  # the batch's own bound
    assert plan([9000], [9500, 40], 0, 16) == ([0, 1], 16)  # off: mlx-lm's order and batching


def test_a_short_prompt_is_not_held_behind_a_long_prefill(tmp_path):
    """A short request that arrives while a prompt over a long context prefills in chunks
    gets its first token before that prefill ends (it joins the prompt batch), where holding
    every prompt behind the long one would keep a chat waiting for a whole agent prefill."""
    from mlxd.engine.batch.messages import AddRequest, StepTokens
    from mlxd.engine.batch.runner import Runner
    from mlxd.engine.load.loader import load_model
    from mlxd.protocol.settings import TuningSettings
    model = write_random_model(tmp_path / "m", context=8192)
    m, _, _ = load_model(str(model), tmp_path / "c")
    outq: queue.Queue = queue.Queue()
    runner = Runner(m, [], batch_size=4, prefill_step=128, outbox=outq, cache_bytes=0,
                    step_target_s=600.0, tuning=TuningSettings(prefill_alone_from=512))
    runner.inbox.put(AddRequest("long", [5 + (i * 7) % 400 for i in range(1500)], 2,
                                greedy_sampler, []))
    runner.take_commands()
    runner.step()  # the long prompt's first chunk
    runner.inbox.put(AddRequest("short", [9 + (i * 3) % 300 for i in range(40)], 2,
                                greedy_sampler, []))
    runner.take_commands()
    first: list[str] = []
    while len(first) < 2:
        runner.step()
        for x in iter_queue(outq):
            if isinstance(x, StepTokens):
                first += [rid for rid, _, _ in x.rows if rid not in first]
    assert first == ["short", "long"]


def iter_queue(q: queue.Queue) -> list:
    out = []
    while not q.empty():
        out.append(q.get())
    return out


def test_a_prefill_several_times_the_hang_timeout_completes_without_a_restart(tmp_path):
    model = write_random_model(tmp_path / "m", hidden=256, layers=6, heads=4, kv_heads=2,
                               intermediate=512, context=4096)
    prompt = [5 + (i * 37) % 400 for i in range(1200)]
    # one chunk of the whole prompt would take several seconds on this CPU
    d = start_daemon(model, "--hang-timeout", "2", "--prefill-step", "2048", isolate=True)
    try:
        t0 = time.monotonic()
        with d.http(timeout=300) as c:
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8,
                                                "temperature": 0})
        took = time.monotonic() - t0
        assert r.status_code == 200, r.text
        st = d.stats()
        assert st["engines"][0]["restarts"] == 0, st["children"]
        assert st["proxy"]["resume"]["resumes"] == 0
        assert st["engines"][0]["steps"] > 3  # the prefill was cut into steps
        text = r.json()["choices"][0]["text"]
    finally:
        stop(d)
    # the answer of an unhurried run: the runner in this process, no chunk control
    from mlxd.engine.batch.messages import AddRequest
    from mlxd.engine.batch.runner import Runner
    from mlxd.engine.load.loader import load_model
    from support.runner_drive import run_one
    m, tok, _ = load_model(str(model), tmp_path / "c")
    outq: queue.Queue = queue.Queue()
    runner = Runner(m, [], batch_size=2, prefill_step=2048, outbox=outq, cache_bytes=0)
    tokens, _ = run_one(runner, outq, AddRequest("x", prompt, 8, greedy_sampler, []))
    assert text == tok.decode(tokens)
    print(f"prefill of {len(prompt)} tokens took {took:.1f} s against a 2 s hang timeout")


def test_a_running_stream_keeps_its_pace_while_a_16k_prompt_prefills(tmp_path):
    """Running streams decode between prefill chunks, and a chunk is kept to the step target
    (2 s at most, engine/batch/timing/chunking.py): while a 16k-token prompt prefills, a running
    stream's gap between tokens stays within about two steps (a step's tokens go out as the
    next step starts its work on the device), 4 s, and half again for this shared CPU: 6 s."""
    import threading
    path = write_random_model(tmp_path / "m", context=16_500)
    d = start_daemon(path, "--ssd-cache", "off", "--prompt-cache", "0", isolate=True)
    try:
        gaps: list[float] = []
        started = threading.Event()

        def stream() -> None:
            last = None
            with httpx.Client(base_url=d.url, timeout=600) as c, c.stream(
                    "POST", "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4000,
                                                     "temperature": 0, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        now = time.monotonic()
                        if last is not None and started.is_set():
                            gaps.append(now - last)
                        last = now
                        if len(gaps) > 20 and not big.is_alive():
                            return
        long_prompt = [5 + (i * 37) % 400 for i in range(16_000)]

        def prefill() -> None:
            started.set()
            with d.http(timeout=600) as c:
                r = c.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 2})
                assert r.status_code == 200
        big = threading.Thread(target=prefill)
        runner = threading.Thread(target=stream)
        runner.start()
        d.wait_until(lambda s: s["engines"][0]["active_requests"] == 1, what="the stream")
        t0 = time.monotonic()
        big.start()
        big.join()
        took = time.monotonic() - t0
        runner.join()
        assert gaps and max(gaps) <= 2 * 2.0 * 1.5, (max(gaps), took)
        print(f"16k prefill took {took:.1f} s; the stream's longest gap {max(gaps):.2f} s")
    finally:
        stop(d)
