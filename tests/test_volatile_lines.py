"""`--volatile-line`: a system-prompt line that changes on every request (Claude Code's billing
header) is dropped before tokenizing, so the prefix cache keeps matching past it; off by
default, counted in /stats."""

from __future__ import annotations

import argparse

import anthropic
import pytest

from conftest import start_daemon
from conftest import stop_and_check as stop
from mlxd.daemon.config import add_serve_arguments, resolve
from mlxd.daemon.settings import ConfigError
from mlxd.proxy.core.volatile import VolatileLines, compile_patterns


def system(n: int) -> str:
    return (f"x-anthropic-billing-header: cc_version=2.0.{n}; cc_entrypoint=cli; cch={n:05x};\n"
            + "You are a careful coding agent. Read files before you edit them. " * 2)


def test_only_whole_named_lines_of_system_messages_are_dropped():
    v = VolatileLines(compile_patterns(["claude-code", r"today is \d+-\d+-\d+"]))
    messages = [{"role": "system", "content": system(1) + "\ntoday is 2026-12-03\nkeep me"},
                {"role": "user", "content": system(2)}]
    out = v.scrub(messages)
    assert out is not None
    assert "billing" not in out[0]["content"] and "today" not in out[0]["content"]
    assert out[0]["content"].startswith("You are a careful") and "keep me" in out[0]["content"]
    assert out[1] == messages[1]  # a user's text is never touched
    assert messages[0]["content"].startswith("x-anthropic")  # the request's own dicts neither
    parts = [{"role": "system", "content": [{"type": "text", "text": system(3)}]}]
    scrubbed = v.scrub(parts)
    assert scrubbed is not None and "billing" not in scrubbed[0]["content"][0]["text"]
    assert (v.dropped, v.requests) == (3, 2)
    assert VolatileLines(None).scrub(messages) is messages  # off: nothing done


def test_a_bad_expression_is_a_config_error():
    ap = argparse.ArgumentParser()
    add_serve_arguments(ap)
    with pytest.raises(ConfigError, match=r"volatile_line \(flag --volatile-line\): not a "):
        resolve(ap.parse_args(["--volatile-line", "([unclosed"]), {})
    good = resolve(ap.parse_args(["--volatile-line", "claude-code"]), {})
    assert good.config.proxy.volatile_line == ["claude-code"]


@pytest.mark.parametrize("flag", [True, False])
def test_claude_codes_billing_line_no_longer_breaks_the_cache(tiny_model, flag):
    d = start_daemon(tiny_model, *(["--volatile-line", "claude-code"] if flag else []),
                     "--ssd-cache", "off")
    try:
        c = anthropic.Anthropic(base_url=d.url, api_key="x", max_retries=0)
        ask = [{"role": "user", "content": "Which file holds the parser?"}]
        first = c.messages.create(model="tiny-llama", max_tokens=3, system=system(1),
                                  messages=ask)
        second = c.messages.create(model="tiny-llama", max_tokens=3, system=system(2),
                                   messages=ask)
        read = second.usage.cache_read_input_tokens or 0
        whole = second.usage.input_tokens + read
        dropped = d.stats()["proxy"]["volatile_lines"]["dropped"]
        if flag:  # all but the token always fed
            assert read == whole - 1 and dropped == 2
            assert first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0) == whole
        else:  # the line differs a few dozen tokens in: nothing after it matches
            assert read < whole / 2 and dropped == 0
    finally:
        stop(d)
