"""Turning a `Generate` into what the runner needs, on an admission lane (never the I/O or
the MLX thread): the prompt's tokens (through the chat template), every check that makes a bad
request a client error before it can reach a batch, the per-request output state, the sampler
and logits processors, and the longest cached prefix from SSD. `prepare` returns either an
engine request (`Admitted`) or an immediate answer (`Answered`). Nothing here touches live MLX
arrays or sockets."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlxd.engine.admit import default_tools
from mlxd.engine.admit.piece_tokens import PieceTokenizer
from mlxd.engine.batch.messages import AddRequest
from mlxd.engine.kv.prefix_cache import RestoredPrefix
from mlxd.engine.state import LoadedModel
from mlxd.engine.wire.output import (
    THINK_CLOSE,
    THINK_OPEN,
    RequestOutput,
    ThinkSplitter,
    ToolCallSplitter,
)
from mlxd.protocol import faults
from mlxd.protocol.messages import PROMPT_SIZE_SLACK, Delta, Generate

log = logging.getLogger("mlxd.engine")


@dataclass
class Admitted:
    """The request goes on: its output state to the output thread, its command to the MLX
    thread (`batch/messages.AddRequest`)."""
    output: RequestOutput
    request: Any
    notice: Delta  # the admission notice (prompt token count): the proxy may start answering


@dataclass
class Answered:
    """The request was answered here: an error, a token count, or nothing left to generate."""
    deltas: list[Delta]


def prepare(msg: Generate, model: LoadedModel | None,
            restore: Callable[[list[int]], RestoredPrefix | None],
            received_at: float, tokens: list[int] | None = None) -> Admitted | Answered:
    """`tokens`: the prompt's tokens where they were already made (`prompt_batch`), else None."""
    rid = msg.request_id
    try:
        if model is None:
            raise ClientError("the model is still loading", "engine_loading")
        return _prepare(msg, model, restore, received_at, tokens)
    except ClientError as e:
        return Answered([Delta(rid, finish_reason="error", error=str(e), error_code=e.code)])
    except Exception as e:  # a bad request must never hurt the engine
        log.exception("request %s could not be prepared", rid)
        return Answered([Delta(rid, finish_reason="error", error=f"invalid request: "
                               f"{str(e)[:500]}", error_code="invalid_request")])


def _prepare(msg: Generate, model: LoadedModel,
             restore: Callable[[list[int]], RestoredPrefix | None],
             received_at: float, tokens: list[int] | None) -> Admitted | Answered:
    from mlxd.engine.admit.sampling import make_request_sampler
    rid, tok = msg.request_id, model.tokenizer
    check_prompt_size(msg, model.context_length, model.max_token_bytes)
    prompt = checked_prompt(tok, msg, tokens if tokens is not None
                            else prompt_tokens(tok, msg, model.pieces))
    check_logit_bias(msg, len(tok))
    if msg.count_only:
        return Answered([Delta(rid, prompt_tokens=len(prompt)),
                         Delta(rid, finish_reason="length", prompt_tokens=len(prompt))])
    p = msg.sampling
    max_tokens = max(1, min(p.max_tokens, room_for(prompt, model.context_length)))
    resumed = list(msg.resume_token_ids)
    out = request_output(tok, msg, prompt, model.eos_ids)
    if resumed:
        out.prime(resumed, msg.resume_text_len)
        max_tokens -= len(resumed)
        prompt = prompt + resumed
        if max_tokens < 1:  # it had delivered everything but the finish
            return Answered([Delta(rid, prompt_tokens=out.prompt_tokens),
                             Delta(rid, finish_reason="length", prompt_tokens=out.prompt_tokens,
                                   completion_tokens=out.completion_tokens)])
    restored = restore(prompt)
    request = AddRequest(rid, prompt, max_tokens,
                         make_request_sampler(p, start_position=len(resumed)),
                         processors(msg, model.grammar_tokenizer, resumed, max_tokens,
                                    default_tool_grammar(tok, msg)),
                         restored=restored, received_at=received_at,
                         logprobs=p.logprobs, group=msg.prefill_group,
                         group_size=msg.group_size)
    notice = Delta(rid, prompt_tokens=out.prompt_tokens)
    if msg.echo_prompt and msg.prompt_token_ids is not None:
        notice.prompt_text = tok.decode(list(msg.prompt_token_ids))
    return Admitted(out, request, notice)


def refused(request_id: str, why: str, code: str = "invalid_request") -> Answered:
    """A request answered with a client error before it reached the MLX thread."""
    return Answered([Delta(request_id, finish_reason="error", error=why, error_code=code)])


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
        raise ClientError(f"the prompt is {chars} characters (at least {chars // token_bytes} "
                          f"tokens), far more than this model's context of {context_length} "
                          f"tokens can hold", "context_length_exceeded")


def prompt_tokens(tok: Any, msg: Generate, pieces: PieceTokenizer | None = None) -> list[int]:
    """`pieces`: a chat prompt is rendered, then tokenized by its parts, those already seen
    kept (`piece_tokens.py`); else the template tokenizes it whole."""
    if msg.suffix is not None:
        prompt = fill_in_the_middle(tok, msg.prompt or "", msg.suffix)
    elif msg.prompt_token_ids is not None:
        prompt = list(msg.prompt_token_ids)
    elif msg.messages is not None:
        by_parts = pieces is not None and pieces.on
        rendered = render_chat(tok, msg, tokenize=not by_parts)
        ids = (pieces.checked(rendered) if pieces is not None and by_parts
               and isinstance(rendered, str) else None)
        if ids is not None:
            return ids
        prompt = list(render_chat(tok, msg, tokenize=True) if isinstance(rendered, str)
                      else rendered)
    else:
        prompt = list(tok.encode(msg.prompt or ""))
    return prompt


def render_chat(tok: Any, msg: Generate, tokenize: bool) -> Any:
    """The chat template applied to the request's messages; tools in the template's own format,
    or, for a template without one, in the default tool prompt (`default_tools`), in the
    system message or, where the template refuses a system role, in the first user turn."""
    assert msg.messages is not None
    if default_tools.applies(tok, msg.tools, msg.messages, msg.grammar):
        assert msg.tools is not None
        variants = [default_tools.with_tool_prompt(msg.messages, msg.tools, fold)
                    for fold in (False, True)]
        extra: dict[str, Any] = {}
    else:
        variants = [msg.messages]
        extra = {"tools": msg.tools} if msg.tools else {}
    for i, messages in enumerate(variants):
        try:
            return tok.apply_chat_template(messages, tokenize=tokenize, **template_flags(msg),
                                           **extra)
        except Exception as e:  # template errors are the client's messages
            if i == len(variants) - 1:
                raise ClientError(f"the chat template rejected the messages: {e}",
                                  "invalid_messages") from e
    raise AssertionError("unreachable")


def checked_prompt(tok: Any, msg: Generate, prompt: list[int]) -> list[int]:
    if not prompt:
        raise ClientError("the prompt is empty", "empty_prompt")
    if faults.armed("engine.poison") and "MLXD_POISON" in str(msg.messages or msg.prompt):
        faults.hit("engine.poison")  # tests: a request that kills whatever engine runs it
    vocab = len(tok)
    if any(t < 0 or t >= vocab for t in prompt):
        raise ClientError("a prompt token id is outside the vocabulary", "invalid_token")
    return prompt


def template_flags(msg: Generate) -> dict[str, bool]:
    """The chat template's flags for the request's messages: assistant prefill continues the
    last turn instead of opening a new one."""
    if continues_final_message(msg.messages or []):
        return {"add_generation_prompt": False, "continue_final_message": True}
    return {"add_generation_prompt": msg.add_generation_prompt}


def continues_final_message(messages: list[dict]) -> bool:
    """Assistant prefill, in every dialect: a conversation ending with an assistant turn that
    has text (and no tool calls) is continued, not closed and answered by a new turn."""
    last = messages[-1] if messages else None
    return isinstance(last, dict) and last.get("role") == "assistant" \
        and isinstance(last.get("content"), str) and bool(last["content"]) \
        and not last.get("tool_calls")


# Fill-in-the-middle tokens (prefix, suffix, middle) of the families that have them, in the
# prefix-suffix-middle order their models were trained on.
FIM_TOKENS = [("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SmolLM
              ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
              ("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>",
               "<\uff5cfim\u2581end\uff5c>")]  # DeepSeek-Coder


def fim_tokens(tok: Any) -> tuple[int, int, int] | None:
    """The model's fill-in-the-middle token ids, if its vocabulary has a family's set."""
    for names in FIM_TOKENS:
        ids = [tok.convert_tokens_to_ids(n) for n in names]
        if all(isinstance(i, int) and tok.convert_ids_to_tokens(i) == n
               for i, n in zip(ids, names, strict=True)):
            return ids[0], ids[1], ids[2]
    return None


def fill_in_the_middle(tok: Any, prefix: str, suffix: str) -> list[int]:
    """<prefix token> prefix <suffix token> suffix <middle token>: the model writes the middle.
    Client text is encoded as text, so FIM tokens written in it are not markers."""
    ids = fim_tokens(tok)
    if ids is None:
        raise ClientError("`suffix` (fill-in-the-middle) needs a model whose tokenizer has "
                          "fill-in-the-middle tokens, and this one has none", "invalid_request")
    pre, suf, mid = ids
    head = list(tok.encode("", add_special_tokens=True))  # BOS, for tokenizers that add one
    return [*head, pre, *tok.encode(prefix, add_special_tokens=False), suf,
            *tok.encode(suffix, add_special_tokens=False), mid]


def check_logit_bias(msg: Generate, vocab: int) -> None:
    for token in msg.sampling.logit_bias:
        if not 0 <= token < vocab:
            raise ClientError(f"`logit_bias` names token id {token}, outside this model's "
                              f"vocabulary of {vocab} tokens", "invalid_token")


def capabilities(tok: Any) -> list[str]:
    """What the model can do, in Ollama's words."""
    template = str(getattr(tok, "chat_template", None) or "")
    out = ["completion"]
    if default_tools.has_chat_template(tok):
        out.append("tools")  # in the template's own format, or the default tool prompt's
    if THINK_CLOSE in template:
        out.append("thinking")
    if fim_tokens(tok) is not None:
        out.append("insert")
    return out


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
    """Free generation with tools: calls in the format mlx-lm knows for the model, or in the
    default tool prompt's (a forced call is constrained JSON instead and needs no parsing)."""
    if not msg.tools or msg.grammar is not None:
        return None
    if default_tools.native(tok):
        return ToolCallSplitter(tok.tool_call_start, tok.tool_call_end, tok.tool_parser,
                                msg.tools)
    if default_tools.applies(tok, msg.tools, msg.messages, msg.grammar):
        return ToolCallSplitter(default_tools.TOOL_CALL_START, default_tools.TOOL_CALL_END,
                                default_tools.parse_tool_call, msg.tools)
    return None


def default_tool_grammar(tok: Any, msg: Generate) -> str | None:
    """The text-or-call grammar of a free chat request with tools on a model without a tool
    format (`default_tools`); None where the request has its own constraint or needs none."""
    if not default_tools.applies(tok, msg.tools, msg.messages, msg.grammar):
        return None
    assert msg.tools is not None
    return default_tools.text_or_call_grammar(msg.tools, tok)


def processors(msg: Generate, grammar_tokenizer: Any, resumed: list[int],
               max_tokens: int | None = None, grammar: str | None = None) -> list:
    """`max_tokens`: the row's budget, within which a JSON schema's document is closed;
    `grammar`: the engine's own constraint where the request has none (`default_tool_grammar`)."""
    from mlxd.engine.admit.sampling import make_request_processors
    out = make_request_processors(msg.sampling)
    grammar = msg.grammar if msg.grammar is not None else grammar
    if grammar is not None:
        from mlxd.engine.grammar.processor import ConstraintError, GrammarProcessor
        try:
            out.append(GrammarProcessor(grammar_tokenizer, grammar, replay=resumed,
                                        max_tokens=max_tokens))
        except (ConstraintError, ValueError) as e:
            raise ClientError(f"the output constraint cannot be used: {e}",
                              "invalid_request") from e
    return out
