"""How the engines of one daemon share the machine's memory (`--batch auto` with a model pool).
Pure logic: the supervisor passes in what it knows of its engines.

Each engine sizes its KV budget at load from the memory it finds (engine/batch_sizing.py); alone
it may take all of it. Engines of a pool would each find the same free memory and together
admit several times what fits, so the supervisor grants each engine a fraction of the memory
the machine can give, weights included, when it first starts it:

- an equal part of what the engines holding a share leave: `(1 - their fractions) / (pool -
  their number)`. The first engine of `--model-pool 2` gets 1/2 before the second is known,
  so the second, whatever its size, still finds its half; the fractions never sum past 1;
- a restarted engine keeps its fraction (same model, same memory);
- an unloaded (evicted) engine's fraction returns at once, to the next engine started: the
  running engines keep theirs (their budgets are fixed at load);
- weights are inside the fraction, so a big model's part holds mostly weights and a small
  model's mostly KV; the engine divides its part into weights, its prefix cache's capacity,
  a reserve and KV (engine/batch_budget.py).

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
class Holder:
    """An engine that holds a share: its fraction, and its weights if it is loaded (else 0)."""
    fraction: float
    loaded_weight_bytes: int = 0


def fraction_for(pool: int, others: list[float]) -> float:
    """The fraction a new engine gets beside engines holding `others`."""
    left = 1.0 - sum(others)
    slots = pool - len(others)
    if slots >= 1 and left > 1e-9:
        return left / slots
    # more engines than the pool holds (a reload racing an unload): equal parts of the whole,
    # which may oversubscribe until one goes; never nothing, or the engine could not serve
    return 1.0 / (len(others) + 1)


def grant(pool: int, holders: list[Holder]) -> PoolShare:
    """The share of a new engine started beside `holders` (the other engines with a share)."""
    if pool <= 1 and not holders:
        return PoolShare()
    return PoolShare(fraction=fraction_for(pool, [h.fraction for h in holders]), pool=pool,
                     others=len(holders),
                     others_weight_bytes=sum(h.loaded_weight_bytes for h in holders))


def relaunch(share: PoolShare, holders: list[Holder]) -> PoolShare:
    """A restarted engine's share: its fraction kept, the others' weights as they are now."""
    return PoolShare(fraction=share.fraction, pool=share.pool, others=len(holders),
                     others_weight_bytes=sum(h.loaded_weight_bytes for h in holders))


def share_of(child: Child, children: Iterable[Child], pool: int,
             weight_of: Callable[[str], int] | None = None) -> PoolShare:
    """The share `child` (an engine about to be spawned) is launched with: granted at its
    first start beside the other engines holding one (an unloaded engine holds none, even
    while it exits), kept across restarts. The weights of the others that are ready (loaded)
    are counted back; a loading one's may not be in memory yet."""
    weight_of = weight_of or weight_bytes_on_disk
    holders = [Holder(c.share.fraction, weight_of(c.model) if c.state == "ready" else 0)
               for c in children
               if c.role == "engine" and c is not child and not c.removed
               and c.share is not None]
    if child.share is None:
        return grant(pool, holders)
    return relaunch(child.share, holders)


def weight_bytes_on_disk(spec: str) -> int:
    """A model directory's weights (its safetensors files); 0 for a spec that is not a local
    directory (a repo id, the default model): the budget is then only smaller."""
    path = Path(spec).expanduser()
    try:
        return sum(f.stat().st_size for f in path.glob("*.safetensors")) if path.is_dir() else 0
    except OSError:
        return 0
