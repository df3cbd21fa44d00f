"""An idle engine gives MLX's reusable buffers back (engine/batch/runner.py,
`_release_idle_memory`): a daemon idle for hours holds its weights and its RAM prefix cache,
not the peak of the last long prefill."""

from __future__ import annotations

import queue

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from mlxd.engine.batch.messages import AddRequest
from mlxd.engine.batch.runner import Runner
from mlxd.engine.load.loader import load_model
from support.random_model import write_random_model
from support.runner_drive import run_one


def test_an_idle_runner_gives_mlxs_buffers_back_and_keeps_its_prefix_cache(tmp_path):
    model = write_random_model(tmp_path / "m", context=4096)
    m, _, _ = load_model(str(model), tmp_path / "c")
    outq: queue.Queue = queue.Queue()
    runner = Runner(m, [], batch_size=2, prefill_step=512, outbox=outq, cache_bytes=1 << 30)
    prompt = [5 + (i * 37) % 400 for i in range(1500)]
    run_one(runner, outq, AddRequest("a", prompt, 4, greedy_sampler, []))
    assert mx.get_cache_memory() > 0  # the prefill's buffers, kept by MLX for reuse
    held = runner.cache.nbytes
    assert held > 0  # the finished request's history, in the RAM tier
    assert runner._handle_commands(block=True)  # nothing comes: idle
    assert mx.get_cache_memory() == 0
    assert runner.cache.nbytes == held
    # a second request is served from the RAM tier as before
    tokens, started = run_one(runner, outq, AddRequest("b", prompt, 4, greedy_sampler, []))
    assert started.cached_tokens == len(prompt) - 1, started
