"""The official clients' (openai, anthropic) response types, narrowed for tests: each helper
asserts that a content block, tool call or field is the kind the test expects and returns it
with its precise type, so a test reads `text_of(m.content[0])` rather than an isinstance check
before every attribute."""

from __future__ import annotations

from anthropic.types import TextBlock, ThinkingBlock, ToolUseBlock, Usage
from openai.types.chat import ChatCompletionMessage, ChatCompletionMessageFunctionToolCall
from openai.types.chat.chat_completion_chunk import ChoiceDelta, ChoiceDeltaToolCall


def text_of(block: object) -> str:
    """The text of an Anthropic content block that must be a text block."""
    assert isinstance(block, TextBlock), block
    return block.text


def thinking_of(block: object) -> str:
    """The thinking of an Anthropic content block that must be a thinking block."""
    assert isinstance(block, ThinkingBlock), block
    return block.thinking


def tool_use_of(block: object) -> ToolUseBlock:
    """An Anthropic content block that must be a tool_use block."""
    assert isinstance(block, ToolUseBlock), block
    return block


def prompt_tokens(usage: Usage) -> int:
    """An Anthropic usage's whole prompt: the tokens prefilled plus those read from the cache
    (mlxd always reports both)."""
    assert usage.cache_read_input_tokens is not None
    return usage.input_tokens + usage.cache_read_input_tokens


def function_calls(message: ChatCompletionMessage) -> list[ChatCompletionMessageFunctionToolCall]:
    """The tool calls of an OpenAI message that must have some, all of them function calls (mlxd
    makes no custom tool calls)."""
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert isinstance(call, ChatCompletionMessageFunctionToolCall), call
    return [call for call in message.tool_calls
            if isinstance(call, ChatCompletionMessageFunctionToolCall)]


def streamed_call(call: ChoiceDeltaToolCall) -> tuple[str, str, str]:
    """(id, function name, arguments) of a streamed OpenAI tool call that arrived whole in one
    delta, as mlxd sends them."""
    assert call.id is not None and call.function is not None, call
    assert call.function.name is not None and call.function.arguments is not None, call
    return call.id, call.function.name, call.function.arguments


def reasoning_of(message: ChatCompletionMessage | ChoiceDelta) -> str | None:
    # `reasoning_content` is mlxd's extension (as in DeepSeek's and vLLM's APIs); the openai SDK
    # keeps it as an undeclared extra field.
    return getattr(message, "reasoning_content", None)
