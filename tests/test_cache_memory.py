"""Counted bytes are held bytes: after rounds of many concurrent streams, what MLX holds
beyond the weights is what the RAM tier counts (its entries are evaluated copies that pin no
batch buffer), for a plain KV model and for one with sliding-window snapshots. Through a real
`--isolate` daemon, as the engine's own figures in `/stats` report it."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from conftest import start_daemon
from conftest import stop_and_check as stop
from support.random_model import write_random_model

ROUNDS, STREAMS = 3, 128


async def one_round(url: str, rng: random.Random) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        async def stream(prompt: list[int]) -> None:
            async with c.stream("POST", "/v1/completions", json={
                    "prompt": prompt, "max_tokens": 8, "temperature": 0,
                    "stream": True}) as r:
                assert r.status_code == 200
                async for _ in r.aiter_lines():
                    pass
        await asyncio.gather(*(stream([rng.randrange(5, 300)
                                       for _ in range(rng.randrange(40, 120))])
                               for _ in range(STREAMS)))


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_what_mlx_holds_beyond_the_weights_is_what_the_ram_tier_counts(family, tmp_path):
    model = write_random_model(tmp_path / family, family=family, context=1024)
    d = start_daemon(model, "--ssd-cache", "off", isolate=True)
    try:
        rng = random.Random(5)
        for _ in range(ROUNDS):
            asyncio.run(one_round(d.url, rng))
        d.wait_until(lambda s: s["engines"][0]["cache"]["prompt_tokens"] > 0
                     and s["engines"][0]["active_requests"] == 0
                     and s["engines"][0]["cache"]["ram_entries"] >= ROUNDS * STREAMS // 2,
                     what="the engine's figures after the rounds")
        cache = d.stats()["engines"][0]["cache"]
        held = cache["mlx_active_bytes"] - cache["weights_bytes"]
        counted = cache["ram_bytes"]
        assert counted > 1_000_000, cache  # the rounds filled the tier
        # MLX holds little else once no row runs (a few small arrays of the generator's)
        assert held <= 1.2 * counted, (held, counted)
        print(f"{family}: MLX holds {held / 1e6:.1f} MB beyond the weights, the RAM tier "
              f"counts {counted / 1e6:.1f} MB ({held / counted:.2f}x)")
    finally:
        stop(d)
