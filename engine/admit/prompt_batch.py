"""Chat prompts of a burst tokenized together, on one admission lane: one call of the chat
template over every conversation that shares its flags, and one call of the tokenizer over the
texts (the Rust tokenizer's batch, the GIL released), instead of a call each.

Apart from what it saves in Python per request, it keeps a burst's lane threads from taking the
GIL from each other (and from the I/O thread still receiving the burst) at every step of every
request, so a burst's requests queue for the lanes for less and its last request is ready
sooner (benchmarks/RESULTS.md, "First token of a burst").
The tokens are transformers' own (`apply_chat_template` of a list of conversations renders each
and tokenizes the texts in one call, as it does one).

A request whose conversation cannot go with others (tools, a completion prompt, token ids,
fill-in-the-middle, a prompt over the size check) is not batched, and a group whose call fails
(one conversation the template rejects) is left to the per-request path, which gives each
request its own answer.
"""

from __future__ import annotations

import logging
from collections import defaultdict

from mlxd.engine.admit.prepare import ClientError, check_prompt_size, template_flags
from mlxd.engine.state import LoadedModel
from mlxd.protocol.messages import Generate

log = logging.getLogger("mlxd.engine")


def batchable(msg: Generate) -> bool:
    return (msg.messages is not None and msg.suffix is None and msg.prompt_token_ids is None
            and not msg.tools and not msg.images and not msg.adapter)


def chat_tokens(msgs: list[Generate], model: LoadedModel) -> list[list[int] | None]:
    """Each request's prompt tokens where they were made here, None where the request must
    be tokenized on its own."""
    out: list[list[int] | None] = [None] * len(msgs)
    groups: dict[tuple[tuple[str, bool], ...], list[int]] = defaultdict(list)
    for i, msg in enumerate(msgs):
        if not batchable(msg):
            continue
        try:
            check_prompt_size(msg, model.context_length, model.max_token_bytes)
        except ClientError:
            continue
        groups[tuple(sorted(template_flags(msg).items()))].append(i)
    for flags, members in groups.items():
        if len(members) < 2:
            continue
        try:
            got = model.tokenizer.apply_chat_template(
                [msgs[i].messages for i in members], tokenize=True, **dict(flags))
        except Exception:  # noqa: BLE001 - one bad conversation: each goes on its own
            log.debug("a batch of %d chat prompts went back to one at a time", len(members))
            continue
        if hasattr(got, "keys"):  # a BatchEncoding, where a tokenizer returns one
            got = got["input_ids"]
        if len(got) != len(members) or not all(isinstance(ids, list) for ids in got):
            continue  # a template of the tokenizer wrapper's own that does not batch
        for i, ids in zip(members, got, strict=True):
            out[i] = list(ids)
    return out
