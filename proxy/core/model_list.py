"""The models the daemon serves, as one list every dialect shapes its own way (runs in the
proxy): OpenAI's `/v1/models`, Anthropic's (the same route with `anthropic-version`)."""

from __future__ import annotations

from typing import Any

from mlxd.protocol.models import declared_context_length, model_id
from mlxd.proxy.bounds import clip
from mlxd.proxy.errors import APIError
from mlxd.proxy.state import ProxyState


def context_fields(context: int) -> dict[str, int]:
    """The model's context length under the names clients read it by (vLLM's `max_model_len`,
    LM Studio's and OpenRouter's `context_length`): the engine's once it has loaded the model,
    its config.json's before (a local directory; none for a repo id not loaded yet)."""
    return {"context_length": context, "max_model_len": context} if context else {}


def served_models(proxy: ProxyState) -> list[dict[str, Any]]:
    """Resident and configured models, with their state and the names they answer to, in
    OpenAI's model shape (and the fields other clients read)."""
    client, router = proxy.client, proxy.router
    resident = router.pool.resident if router.pool is not None else client.engines
    data: list[dict[str, Any]] = []
    for rec in client.engines.values():
        state = rec.state if rec.engine_id in resident or rec.state == "failed" else "unloaded"
        data.append({"id": rec.model_id, "object": "model", "created": proxy.started,
                     "owned_by": "mlxd", "state": state, "aliases": rec.names,
                     **context_fields((rec.status.context_length if rec.status else 0)
                                      or declared_context_length(rec.spec))})
    listed = {n for d in data for n in d["aliases"]}
    for name, spec in router.adapters.items():  # LoRA adapters: served by their base's engine
        base = next((d for d in data if spec in d["aliases"] or d["id"] == model_id(spec)),
                    None)
        data.append({"id": name, "object": "model", "created": proxy.started,
                     "owned_by": "mlxd", "state": base["state"] if base else "unloaded",
                     "aliases": [name], "parent": model_id(spec),
                     "root": router.adapter_dirs[name].partition(":")[2],
                     **context_fields(base.get("context_length", 0) if base else 0)})
    listed |= set(router.adapters)
    for alias, spec in router.aliases.items():
        if alias not in listed:
            data.append({"id": alias, "object": "model", "created": proxy.started,
                         "owned_by": "mlxd", "state": "unloaded", "aliases": [alias, spec]})
    return data


def find_model(proxy: ProxyState, name: str) -> dict[str, Any]:
    """One served model by any name it answers to; 404 `model_not_found` otherwise."""
    found = next((m for m in served_models(proxy) if name == m["id"] or name in m["aliases"]),
                 None)
    if found is None:
        raise APIError(404, f"the model {clip(name)!r} does not exist", code="model_not_found",
                       param="model")
    return found
