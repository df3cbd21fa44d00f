"""The engine's report of itself to the proxy (`EngineStatus`): state, batch figures, and the
prompt, timing and KV-cache figures of both tiers. Built on the output thread from counters
the other threads advance (plain integers: a read is never torn)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import msgspec

from mlxd.engine.admit.prepare import capabilities
from mlxd.engine.state import LoadedModel
from mlxd.protocol.messages import EngineState, EngineStats, EngineStatus
from mlxd.protocol.models import model_id, model_names
from mlxd.protocol.settings import EngineLaunch

if TYPE_CHECKING:
    from mlxd.engine.batch.runner import Runner
    from mlxd.engine.kv.ssd_tier import SsdTier


def engine_stats(runner: Runner, ssd: SsdTier | None) -> EngineStats:
    import mlx.core as mx
    c, cache = runner.counters, runner.cache
    st = EngineStats(
        ram_bytes=cache.nbytes, ram_entries=len(cache), ram_capacity_bytes=cache.max_bytes,
        ram_hits=cache.stats.hits, ram_misses=cache.stats.misses,
        ram_evictions=cache.stats.evictions, prompt_tokens=c.prompt_tokens,
        prefilled_tokens=c.prefilled_tokens, cached_tokens=c.cached_tokens,
        checkpoints=c.checkpoints, checkpoint_s=round(c.checkpoint_s, 4),
        step_s=round(c.step_s, 4), first_tokens=c.first_tokens,
        to_admit_s=round(c.to_admit_s, 4), to_first_token_s=round(c.to_first_token_s, 4),
        mlx_active_bytes=mx.get_active_memory(), mlx_cache_bytes=mx.get_cache_memory(),
        bursts=c.bursts, cache_layers=runner.codec.describe(),
        ram_snapshots=cache.snapshots, cache_unsupported=runner.codec.unsupported,
        weights_bytes=runner.weights_bytes, ram_superseded=cache.stats.superseded,
        ram_kept_bytes=cache.kept_bytes, longest_step_s=round(c.longest_step_s, 4),
        pace_s=round(c.pace_s, 4))
    budget = runner.gate.budget  # None: no memory rule
    if budget is not None:
        st.kv_budget_bytes, st.memory_share = budget.kv_bytes, budget.share
    spec = runner.spec
    if spec is not None:
        sc = spec.counters
        st.spec_mode, st.spec_steps, st.spec_drafted = spec.mode, sc.steps, sc.drafted
        st.spec_accepted, st.spec_tokens, st.spec_skipped = sc.accepted, sc.tokens, sc.skipped
        st.spec_missed, st.spec_batched = sc.missed, sc.batched
        st.spec_acceptance = round(sc.accepted / sc.drafted, 4) if sc.drafted else 0.0
        st.spec_tokens_per_step = round(sc.tokens / sc.steps, 3) if sc.steps else 0.0
    if ssd is not None:
        ssd.fill_stats(st)
    return st


def base_status(launch: EngineLaunch, state: EngineState, error: str | None) -> EngineStatus:
    """What any engine says of itself, loaded or not."""
    spec = launch.model
    return EngineStatus(
        engine_id=launch.engine_id, epoch=launch.epoch, pid=os.getpid(),
        model_id=model_id(spec), model_names=model_names(spec), state=state, error=error,
        model_spec=spec, group=launch.group, stats=EngineStats())


def generating_status(status: EngineStatus, model: LoadedModel, runner: Runner,
                      ssd: SsdTier | None) -> EngineStatus:
    """A generating engine's figures: its model, its runner's counters, both tiers'."""
    c = runner.counters
    return msgspec.structs.replace(
        status, active=c.active, peak_batch=c.peak_batch, steps=c.steps,
        context_length=model.context_length, prompt_tokens_total=c.prompt_tokens,
        generated_tokens_total=c.generated_tokens, stats=engine_stats(runner, ssd),
        max_token_bytes=model.max_token_bytes,
        model_dir=str(getattr(model.tokenizer, "name_or_path", "")),
        capabilities=capabilities(model.tokenizer), batch_cap=c.batch_cap,
        batch_why=c.batch_why, waiting=c.waiting)
