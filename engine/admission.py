"""Turning a `Generate` into what the runner needs, on the engine's I/O thread: the prompt's
tokens (through the chat template), every check that makes a bad request a client error before
it can reach a batch, the per-request output state, and the logits processors (penalties, the
output grammar). Nothing here touches MLX arrays or sockets."""

from __future__ import annotations

from typing import Any

from mlxd.engine.output import (THINK_CLOSE, THINK_OPEN, RequestOutput, ThinkSplitter,
                                ToolCallSplitter)
from mlxd.protocol import faults
from mlxd.protocol.messages import PROMPT_SIZE_SLACK, Generate


class ClientError(Exception):
    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def prompt_chars(msg: Generate) -> int:
    """Characters of text the request asks to tokenize (its messages' or its prompt's)."""
    if msg.prompt_token_ids is not None:
        return 0
    if msg.messages is not None:
        n = 0
        for m in msg.messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                n += len(content)
        return n
    return len(msg.prompt or "")


def max_token_bytes(tok: Any) -> int:
    """An upper bound on the bytes of text one token covers: the longest vocabulary entry in
    UTF-8 (byte-level BPE writes each byte as one character, SentencePiece writes a space as
    three bytes; either way the entry is at least as long as the text it stands for)."""
    try:
        vocab = tok.get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary: no early check
        return 0
    return max((len(k.encode("utf-8", "surrogatepass")) for k in vocab), default=0)


def check_prompt_size(msg: Generate, context_length: int, token_bytes: int) -> None:
    """Refuse a prompt that obviously exceeds the context before spending time tokenizing."""
    if msg.prompt_token_ids is not None:
        if len(msg.prompt_token_ids) >= context_length > 0:
            raise ClientError(f"the prompt is {len(msg.prompt_token_ids)} tokens, but this "
                              f"model's context is {context_length} tokens",
                              "context_length_exceeded")
        return
    chars = prompt_chars(msg)
    limit = context_length * token_bytes * PROMPT_SIZE_SLACK
    if limit and chars > limit:
        raise ClientError(f"the prompt is {chars} characters, far more than this model's "
                          f"context of {context_length} tokens can hold",
                          "context_length_exceeded")


def prompt_tokens(tok: Any, msg: Generate) -> list[int]:
    if msg.prompt_token_ids is not None:
        prompt = list(msg.prompt_token_ids)
    elif msg.messages is not None:
        try:
            extra = {"tools": msg.tools} if msg.tools else {}
            prompt = list(tok.apply_chat_template(
                msg.messages, add_generation_prompt=msg.add_generation_prompt, tokenize=True,
                **extra))
        except Exception as e:  # noqa: BLE001 - template errors are the client's messages
            raise ClientError(f"the chat template rejected the messages: {e}",
                              "invalid_messages") from e
    else:
        prompt = list(tok.encode(msg.prompt or ""))
    if not prompt:
        raise ClientError("the prompt is empty", "empty_prompt")
    if faults.armed("engine.poison") and "MLXD_POISON" in str(msg.messages or msg.prompt):
        faults.hit("engine.poison")  # tests: a request that kills whatever engine runs it
    vocab = len(tok)
    if any(t < 0 or t >= vocab for t in prompt):
        raise ClientError("a prompt token id is outside the vocabulary", "invalid_token")
    return prompt


def room_for(prompt: list[int], context_length: int) -> int:
    room = context_length - len(prompt)
    if room < 1:
        raise ClientError(f"the prompt is {len(prompt)} tokens, but this model's context is "
                          f"{context_length} tokens", "context_length_exceeded")
    return room


def request_output(tok: Any, msg: Generate, prompt: list[int],
                   eos_ids: frozenset[int]) -> RequestOutput:
    return RequestOutput(msg.request_id, tok.detokenizer, list(msg.sampling.stop), eos_ids,
                         len(prompt), splitter=think_splitter(tok, msg, prompt),
                         tool_splitter=tool_splitter(tok, msg))


def think_splitter(tok: Any, msg: Generate, prompt: list[int]) -> ThinkSplitter | None:
    """Chat requests to a model whose template knows `<think>` get their thinking split from
    the answer; a prompt ending inside an opened `<think>` starts in thinking."""
    template = getattr(tok, "chat_template", None) or ""
    if msg.messages is None or THINK_CLOSE not in str(template):
        return None
    tail = tok.decode(prompt[-8:])
    return ThinkSplitter(prefilled=tail.rfind(THINK_OPEN) > tail.rfind(THINK_CLOSE))


def tool_splitter(tok: Any, msg: Generate) -> ToolCallSplitter | None:
    """Free generation with tools, on a model mlx-lm knows a tool-call format for (a forced
    call is constrained JSON instead and needs no parsing)."""
    if not msg.tools or msg.grammar is not None or not tok.has_tool_calling:
        return None
    return ToolCallSplitter(tok.tool_call_start, tok.tool_call_end, tok.tool_parser, msg.tools)


def processors(msg: Generate, grammar_tokenizer: Any, resumed: list[int]) -> list:
    from mlxd.engine.sampling import make_request_processors
    out = make_request_processors(msg.sampling)
    if msg.grammar is not None:
        from mlxd.engine.constraints import ConstraintError, GrammarProcessor
        try:
            out.append(GrammarProcessor(grammar_tokenizer, msg.grammar, replay=resumed))
        except (ConstraintError, ValueError) as e:
            raise ClientError(f"the output constraint cannot be used: {e}",
                              "invalid_request") from e
    return out
