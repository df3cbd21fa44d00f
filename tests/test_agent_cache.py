"""A full RAM tier under agent sessions, through a real `--isolate` daemon: a cache far smaller
than the work (and an SSD tier with one write slot) never holds a request back, sessions'
next turns still start from their previous turn, and `/stats` shows the keep policy at work
(engine/kv/keep_policy.py)."""

from __future__ import annotations

import asyncio
import random

import openai
import pytest

from conftest import start_daemon
from conftest import stop_and_check as stop
from support.random_model import write_random_model

WORDS = "sea lighthouse keeper storm harbor rope lantern tide gull anchor".split()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("models") / "agent-llama", context=8192)


async def test_a_full_cache_never_holds_admission_back_and_sessions_keep_their_turns(
        agent_model, tmp_path):
    # 512 bytes of KV per token: room for two sessions' latest turns (~1,500 tokens each at
    # the end) and not for the one-offs (six of ~600 tokens a round)
    d = start_daemon(agent_model, "--prompt-cache", "0.002", "--ssd-cache",
                     str(tmp_path / "kv"), "--kv-slots", "1", "--block-tokens", "16",
                     isolate=True)
    try:
        c = openai.AsyncOpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0)
        rng = random.Random(3)
        system = {"role": "system", "content": "You are a coding agent. " + text(rng, 100)}
        sessions = [[system, {"role": "user", "content": f"Task {i}: " + text(rng, 30)}]
                    for i in range(2)]

        async def ask(messages: list[dict], max_tokens: int = 8):
            return await c.chat.completions.create(model="agent-llama", messages=messages,
                                                   max_tokens=max_tokens, temperature=0)

        async def session_turn(i: int) -> tuple[int, int]:
            r = await ask(sessions[i])
            sessions[i] += [{"role": "assistant", "content": r.choices[0].message.content},
                            {"role": "user", "content": "Tool output: " + text(rng, 40)}]
            u = r.usage
            return u.prompt_tokens, u.prompt_tokens_details.cached_tokens

        last = [0, 0]
        for _ in range(4):
            # both sessions' turns and a burst of one-off prompts (titles, unrelated
            # questions, each its own from the first token) at once, far more than the cache
            # holds
            got = await asyncio.wait_for(asyncio.gather(
                session_turn(0), session_turn(1),
                *(ask([{"role": "user", "content": f"{rng.random()} " + text(rng, 120)}], 4)
                  for _ in range(6))),
                timeout=120)
            for i in range(2):
                prompt, cached = got[i]
                assert cached >= last[i], (i, prompt, cached, last[i])  # the previous prompt
                last[i] = prompt
        cache = d.stats()["engines"][0]["cache"]
        assert cache["ram_evictions"] > 0 and cache["ram_superseded"] > 0, cache
        # the sessions' turns came from RAM: the one-offs went, not a session's entry
        assert cache["ssd_restored_tokens"] == 0 and cache["ssd_blocks_written"] > 0, cache
        assert 0 < cache["ram_kept_bytes"] <= cache["ram_bytes"] <= cache["ram_capacity_bytes"]
        models = await c.models.list()
        assert models.data
    finally:
        stop(d)
