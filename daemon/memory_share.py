"""How the engines of one daemon share the machine's memory (`--batch auto` with a model pool).
Pure logic: the supervisor passes in what it knows of its engines.

Each engine sizes its KV budget from the memory it finds at load (engine/batch/sizing.py);
alone it may take all of it. Engines of a pool would each find the same free memory and
together admit several times what fits, so the supervisor gives each engine a fraction of the
memory the machine can give, weights included, and changes it while the engines run:

- the engines holding a share get equal parts: k of them get 1/k each, whatever the pool's
  size (one alone gets all of it: a desktop with one model loaded gets the whole batch);
- an engine holds a share from the moment it is about to be spawned until its process is
  gone: while it starts, runs, crashes and waits to restart (a restarted engine's part is
  what it was, the set being the same), and while it exits after an unload (its memory is
  still held). A failed engine (crash loop, cannot start) holds none until it is retried;
- the set changes -> every share is recomputed and every running engine told its new part
  (`SetMemoryShare`). A new engine's arrival shrinks the others BEFORE it is spawned; they
  stop admitting rows beyond their new budget at once and trim their prefix caches, while
  running rows finish (see `rebalance` for why the new engine does not wait for that). An
  engine that is gone makes the others grow only once its process has exited;
- weights are inside the fraction, so a big model's part holds mostly weights and a small
  model's mostly KV; the engine divides its part into weights, its prefix cache's capacity,
  a reserve and KV (engine/batch/budget.py), and re-divides it, from the figures it measured
  at load, when its part changes.

Memory the engine finds at load lacks the weights of the engines already loaded, so the
supervisor also passes their size (from their model files) to be counted back: the machine's
memory is then seen alike by every engine whatever the load order. KV another engine holds at
that moment is not counted back, which only makes the new engine's part smaller.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from mlxd.daemon.children import Child
from mlxd.protocol.settings import PoolShare


@dataclass(frozen=True)
class Engine:
    """What the rule knows of one engine child."""
    engine_id: str
    holds: bool  # holds a share (see `holds_share`)
    loaded_weight_bytes: int = 0  # its weights, if they are in memory and stay there; else 0


def shares(pool: int, engines: Iterable[Engine]) -> dict[str, PoolShare]:
    """The share of every engine that holds one: equal parts of the whole. One engine alone
    with no pool (`--model-pool 1`) gets the plain whole (`PoolShare()`)."""
    holders = [e for e in engines if e.holds]
    k = len(holders)
    if k == 1 and pool <= 1:
        return {holders[0].engine_id: PoolShare()}
    weights = sum(e.loaded_weight_bytes for e in holders)
    return {e.engine_id: PoolShare(fraction=1.0 / k, pool=pool, others=k - 1,
                                   others_weight_bytes=weights - e.loaded_weight_bytes)
            for e in holders}


def rebalance(pool: int, engines: Iterable[Engine],
              told: dict[str, float]) -> tuple[dict[str, PoolShare], list[str]]:
    """Every holder's share, and the engines whose fraction differs from what they were told
    (`told`: engine id -> the fraction it runs with, for the engines running now): those the
    supervisor sends their new share to.

    A new engine B does not wait for the others to be under their new budgets: they admit
    nothing more at once, their prefix caches trim at once, and only their running rows may
    still hold more than the new budget, for as long as those rows run. B measures the free
    memory at load as any engine does; memory they still hold makes B's figure, and with it
    B's budget, smaller: the safe direction (not the reverse). Waiting instead would delay
    B's load by as long as the longest running request, for no memory B could have counted."""
    given = shares(pool, engines)
    changed = [eid for eid, fraction in told.items()
               if eid in given and abs(given[eid].fraction - fraction) > 1e-9]
    return given, changed


def holds_share(child: Child) -> bool:
    """An engine about to be spawned, starting, running, restarting (backoff) or exiting: a
    failed one is not (it holds no memory until it is tried again), nor one that is stopped,
    nor an unloaded one whose process is gone."""
    if child.role != "engine" or child.state in ("failed", "stopped"):
        return False
    return not child.removed or child.alive


def engines_of(children: Iterable[Child],
               weight_of: Callable[[str], int] | None = None) -> list[Engine]:
    """The supervisor's children as the rule sees them. The weights counted back are those of
    the engines that are ready and stay (a loading one's may not be in memory yet; an unloaded
    one's may be gone by the time the new engine measures)."""
    weight_of = weight_of or weight_bytes_on_disk
    return [Engine(c.child_id, holds_share(c),
                   weight_of(c.model) if c.state == "ready" and not c.removed else 0)
            for c in children if c.role == "engine"]


def weight_bytes_on_disk(spec: str) -> int:
    """A model directory's weights (its safetensors files); 0 for a spec that is not a local
    directory (a repo id, the default model): the budget is then only smaller."""
    path = Path(spec).expanduser()
    try:
        return sum(f.stat().st_size for f in path.glob("*.safetensors")) if path.is_dir() else 0
    except OSError:
        return 0
