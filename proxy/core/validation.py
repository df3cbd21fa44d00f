"""Request checks every dialect shares (runs in the proxy): `keep_alive`, and whether a prompt
can fit the model's context at all. Body decoding and field bounds are in proxy/bounds.py,
sampling in sampling.py."""

from __future__ import annotations

from mlxd.protocol.messages import PROMPT_SIZE_SLACK, EngineStatus, Generate
from mlxd.proxy.engines.pool import parse_keep_alive
from mlxd.proxy.errors import bad_request


def keep_alive_seconds(raw: float | str | None) -> float | None:
    """`keep_alive` (seconds or "5m"; 0 unloads after the request, -1 pins) in seconds."""
    try:
        return parse_keep_alive(raw)
    except ValueError as e:
        raise bad_request(str(e), param="keep_alive") from e


def check_prompt_fits(msg: Generate, status: EngineStatus | None) -> None:
    """A prompt that cannot fit the model's context, whatever the tokenizer makes of it, is
    refused here: it never reaches the engine to be tokenized."""
    if status is None or not status.context_length:
        return
    ctx = status.context_length
    ids = msg.prompt_token_ids
    if ids is not None:
        if len(ids) >= ctx:
            raise bad_request(f"the prompt is {len(ids)} tokens, but this model's context is "
                              f"{ctx} tokens", code="context_length_exceeded", param="prompt")
        return
    if not status.max_token_bytes:
        return
    chars = len(msg.prompt or "")
    for m in msg.messages or ():
        content = m.get("content")
        chars += len(content) if isinstance(content, str) else 0
    if chars > ctx * status.max_token_bytes * PROMPT_SIZE_SLACK:
        raise bad_request(f"the prompt is {chars} characters (at least "
                          f"{chars // status.max_token_bytes} tokens), far more than this "
                          f"model's context of {ctx} tokens can hold",
                          code="context_length_exceeded")
