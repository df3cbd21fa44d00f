"""The OpenAI request schema (proxy/dialects/openai/schema.py), without processes: sampling
defaults and limits, messages."""

from __future__ import annotations

import pytest

from mlxd.proxy.bounds import decode_body
from mlxd.proxy.core.sampling import Defaults, SamplingRequest, check_sampling
from mlxd.proxy.dialects.openai.schema import ChatRequest, chat_messages, sampling
from mlxd.proxy.errors import APIError


def test_sampling_params_defaults_and_limits():
    req = decode_body(b'{"messages": [{"role": "user", "content": "x"}]}', ChatRequest)
    p = sampling(req, Defaults(temperature=0.7, max_tokens=33)).params
    assert p.temperature == 0.7 and p.max_tokens == 33 and 0 <= p.seed < 2**63
    with pytest.raises(APIError) as e:
        check_sampling(SamplingRequest(max_tokens=0), Defaults())
    assert e.value.status == 400 and "at least 1" in e.value.message
    sampling(req, Defaults()).params_for(100)  # the default is clamped by the engine, not refused
    explicit = decode_body(b'{"messages": [], "max_tokens": 100}', ChatRequest)
    sampling(explicit, Defaults()).params_for(100)
    with pytest.raises(APIError) as e:
        sampling(explicit, Defaults()).params_for(99)
    assert e.value.status == 400 and "context" in e.value.message


def test_chat_messages_join_text_parts_and_map_developer_role():
    req = decode_body(b'{"messages": [{"role": "developer", "content": "be brief"},'
                      b'{"role": "user", "content": [{"type": "text", "text": "a"},'
                      b'{"type": "text", "text": "b"}]}]}', ChatRequest)
    assert chat_messages(req) == [{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": "ab"}]
