"""Per-request output state: streaming detokenization and stop-string matching.

Runs on the engine's output thread, never on the MLX thread: the MLX thread hands over raw
token IDs once per step and this turns them into text deltas for every row at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlxd.protocol.messages import Delta, FinishReason


def stop_hold_length(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` could still begin a stop string."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:n]):
                hold = n
                break
    return hold


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ThinkSplitter:
    """Separates a reasoning model's thinking (`<think>...</think>`) from its answer in a text
    stream, holding back what may be the start of a tag. `prefilled`: the chat template
    already opened the `<think>` block in the prompt."""

    def __init__(self, prefilled: bool) -> None:
        self.state = "think" if prefilled else "start"
        self.buf = ""

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, answer) text that can be sent now."""
        self.buf += text
        reasoning = answer = ""
        while True:
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(THINK_OPEN):
                    self.buf, self.state = head[len(THINK_OPEN):], "think"
                    continue
                if not final and (not head or THINK_OPEN.startswith(head)):
                    return reasoning, answer  # may still become <think>
                self.state = "answer"
                continue
            if self.state == "think":
                i = self.buf.find(THINK_CLOSE)
                if i >= 0:
                    reasoning += self.buf[:i]
                    self.buf, self.state = self.buf[i + len(THINK_CLOSE):].lstrip(), "answer"
                    continue
                hold = 0 if final else stop_hold_length(self.buf, [THINK_CLOSE])
                reasoning += self.buf[:len(self.buf) - hold]
                self.buf = self.buf[len(self.buf) - hold:]
                return reasoning, answer
            answer += self.buf
            self.buf = ""
            return reasoning, answer


class ToolCallSplitter:
    """Cuts a model's tool calls out of its answer text: text between the family's start
    and end markers (mlx-lm's tool parser for the model) is parsed into calls instead of being
    sent as text. A start marker still partial is held back."""

    def __init__(self, start: str, end: str | None, parser: Any, tools: list[dict]) -> None:
        self.start, self.end, self.parser, self.tools = start, end or "", parser, tools
        self.in_call = False
        self.buf = ""

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """(answer text that can be sent now, calls completed now)."""
        self.buf += text
        out = ""
        calls: list[dict] = []
        while True:
            if not self.in_call:
                i = self.buf.find(self.start)
                if i < 0:
                    hold = 0 if final else stop_hold_length(self.buf, [self.start])
                    out += self.buf[:len(self.buf) - hold]
                    self.buf = self.buf[len(self.buf) - hold:]
                    return out, calls
                out += self.buf[:i]
                self.buf, self.in_call = self.buf[i + len(self.start):], True
                continue
            j = self.buf.find(self.end) if self.end else -1
            if j < 0 and not final:
                return out, calls
            body = self.buf if j < 0 else self.buf[:j]
            self.buf = "" if j < 0 else self.buf[j + len(self.end):]
            self.in_call = False
            calls.extend(self._parse(body))
            if j < 0:
                return out, calls

    def _parse(self, body: str) -> list[dict]:
        try:
            parsed = self.parser(body, self.tools)
        except Exception:  # noqa: BLE001 - a malformed call is dropped, like mlx_lm.server does
            return []
        import json
        return [{"name": c["name"], "arguments": json.dumps(c.get("arguments", {}),
                                                            ensure_ascii=False)}
                for c in (parsed if isinstance(parsed, list) else [parsed])
                if isinstance(c, dict) and "name" in c]


@dataclass
class RequestOutput:
    request_id: str
    detokenizer: Any
    stops: list[str]
    eos_ids: frozenset[int]
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    finished: bool = False
    _pending: str = ""  # text held back because it may begin a stop string
    _seen: int = 0  # characters of detokenizer.text already consumed
    token_ids: list[int] = field(default_factory=list)
    splitter: ThinkSplitter | None = None  # reasoning models: thinking apart from the answer
    tool_splitter: ToolCallSplitter | None = None  # requests with tools, on models that call
    _calls: list = field(default_factory=list)  # parsed tool calls not yet sent
    _reasoning: str = ""  # thinking text not yet sent

    def prime(self, tokens: list[int], delivered_chars: int) -> None:
        """Resume: replay what was delivered before a crash, so the text continues exactly
        (held-back characters, multi-byte sequences split across tokens included)."""
        for t in tokens:
            self.detokenizer.add_token(t)
        self.completion_tokens = len(tokens)
        self.token_ids = list(tokens)
        full = self.detokenizer.text
        self._pending = full[delivered_chars:]
        self._seen = len(full)

    def add(self, token: int, finish_reason: FinishReason | None) -> Delta | None:
        """Feed one generated token; return the delta to send (None if nothing to say)."""
        if self.finished:
            return None
        # "length" with the end token: a document a budget closed early (`grammar/budget.py`)
        is_eos = finish_reason in ("stop", "length") and token in self.eos_ids
        new_ids: list[int] = []
        if not is_eos:
            self.detokenizer.add_token(token)
            self.completion_tokens += 1
            new_ids.append(token)
            self.token_ids.append(token)
        if finish_reason is not None:
            self.detokenizer.finalize()
        full = self.detokenizer.text
        fresh = full[self._seen:]
        self._seen = len(full)
        if self.splitter is not None:
            thought, fresh = self.splitter.feed(fresh, final=finish_reason is not None)
            self._reasoning += thought
        if self.tool_splitter is not None:
            fresh, calls = self.tool_splitter.feed(fresh, final=finish_reason is not None)
            self._calls.extend(calls)
        self._pending += fresh

        text = self._pending
        if self.stops:
            hits = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
            if hits:
                cut, stop = min(hits)
                self.finished = True
                self._pending = ""
                return self._delta(text[:cut], new_ids, "stop", stop)
        if finish_reason is not None:
            self.finished = True
            self._pending = ""
            return self._delta(text, new_ids, finish_reason)
        hold = stop_hold_length(text, self.stops) if self.stops else 0
        emit = text[: len(text) - hold]
        self._pending = text[len(text) - hold:]
        if not emit and not new_ids and not self._reasoning and not self._calls:
            return None
        return self._delta(emit, new_ids, None)

    def _delta(self, text: str, ids: list[int], finish: FinishReason | None,
               stop: str | None = None) -> Delta:
        reasoning, self._reasoning = self._reasoning, ""
        calls, self._calls = self._calls, []
        return Delta(request_id=self.request_id, text=text, token_ids=ids, finish_reason=finish,
                     prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                     cached_tokens=self.cached_tokens, stop_sequence=stop, reasoning=reasoning,
                     tool_calls=calls or None)
