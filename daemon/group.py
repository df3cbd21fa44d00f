"""Which engines are served by a group of processes: `--shard NAME=tensor:N|pipeline:N`
names a model alias (`--model-alias NAME=MODEL`), a model as given (path or repo id) or the id
`/v1/models` lists for it (a directory's name); the engine for that model gets the layout in
its launch struct and starts the group itself (`engine/kinds/group/leader.py`). Pure logic.
"""

from __future__ import annotations

from mlxd.protocol.models import model_names


class ShardError(ValueError):
    pass


def layout_for(spec: str, shard: dict[str, str], aliases: dict[str, str]) -> str:
    """The shard layout of the engine for model `spec` ("" for one process). A size of 1 is
    one process; two different layouts for one model are an error."""
    names = [spec, *model_names(spec), *(a for a, s in aliases.items() if s == spec)]
    found = {shard[n].strip() for n in names if n in shard}
    found = {f for f in found if not f.endswith(":1")}
    if len(found) > 1:
        raise ShardError(f"model {spec!r} has two shard layouts: {', '.join(sorted(found))}")
    return next(iter(found), "")

