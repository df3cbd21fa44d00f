"""Pure pieces of issue 15's fixes: JSON cut short made whole (a forced call cut by the length
limit), schemas closed where they say nothing of `additionalProperties`, and the lenient
reading of a forced call."""

from __future__ import annotations

import copy
import json

import pytest

from mlxd.proxy.core.constraints import Tool, closed, forced_call
from mlxd.proxy.core.partial_json import complete


@pytest.mark.parametrize("text, value", [
    ('{"a": 1}', {"a": 1}),
    ('{"a":"Par', {"a": "Par"}),
    ('{"a":"x\\', {"a": "x"}),  # half an escape dropped
    ('{"a":"x\\u00', {"a": "x"}),  # half a \\u escape dropped
    ('{"a":"x\\\\', {"a": "x\\"}),  # a whole escaped backslash kept
    ('{"loc', {}),  # a key without its value
    ('{"a":1,"b":', {"a": 1}),
    ('{"a":12', {"a": 12}),
    ('{"a":tr', {}),
    ('{"a":[1,2,', {"a": [1, 2]}),
    ('{"a":["x",{"b":nu', {"a": ["x", {}]}),
    ('{"name":"get_weather","arguments":{"location":"Pa',
     {"name": "get_weather", "arguments": {"location": "Pa"}}),
    ('[{"a":{"b":[true,', [{"a": {"b": [True]}}]),
    ("", None),
    ("nonsense", None),
])
def test_complete(text, value):
    assert complete(text) == value


def test_every_prefix_of_a_document_completes_to_json():
    doc = json.dumps({"name": "f", "arguments": {"s": "a \"q\" \\ é\n", "n": -1.5e3,
                                                 "l": [True, None, {"k": []}]}})
    for i in range(len(doc) + 1):
        value = complete(doc[:i])
        assert value is None or isinstance(value, dict), doc[:i]
        json.dumps(value)
    assert complete(doc) == json.loads(doc)


def test_closed_schemas():
    schema = {
        "type": "object", "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "string"}}},
            "open": {"type": "object", "properties": {"c": {}}, "additionalProperties": True},
            "free": {"type": "object"},
            "list": {"type": "array", "items": {"properties": {"d": {"type": "integer"}}}},
            "either": {"anyOf": [{"$ref": "#/$defs/E"}, {"type": "null"}]},
            "both": {"allOf": [{"properties": {"f": {}}},
                               {"properties": {"g": {"properties": {"h": {}}}}}]}},
        "$defs": {"E": {"type": "object", "properties": {"e": {"type": "boolean"}}}}}
    before = copy.deepcopy(schema)
    out = closed(schema)
    assert schema == before  # the client's schema is not modified
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["a"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert "additionalProperties" not in props["free"]  # no properties: free-form stays
    assert props["list"]["items"]["additionalProperties"] is False
    assert out["$defs"]["E"]["additionalProperties"] is False
    assert "additionalProperties" not in props["either"]["anyOf"][1]
    f, g = props["both"]["allOf"]  # closed, each would forbid the other's keys
    assert "additionalProperties" not in f and "additionalProperties" not in g
    assert g["properties"]["g"]["additionalProperties"] is False  # what they hold is closed


TOOLS = [Tool("get_weather", "", {"type": "object"}), Tool("get_time", "", {"type": "object"})]


@pytest.mark.parametrize("text, call", [
    ('{"name":"get_time","arguments":{"zone":"UTC"}}', ("get_time", {"zone": "UTC"})),
    ('{"name":"get_weather","arguments":{"city":"Pa', ("get_weather", {"city": "Pa"})),
    ('{"name":"get_t', ("get_time", {})),  # the tool the text began
    ('{"na', ("get_weather", {})),  # not even that: the first tool
    ("", ("get_weather", {})),
])
def test_forced_call_reads_what_was_written(text, call):
    assert forced_call(text, TOOLS) == call


def test_a_schema_sent_again_is_compiled_once_and_its_key_order_kept(monkeypatch):
    """The proxy compiles and validates a schema's grammar once for the requests that send it
    again (an app's response format with every request: ~0.5-1 ms each of the proxy's event
    loop, a burst's requests one after the other); a schema with its keys in another order is
    another grammar (the order is the document's), and a bad schema is a 400 every time."""
    import llguidance

    from mlxd.proxy.core import constraints
    from mlxd.proxy.errors import APIError
    monkeypatch.setattr(constraints, "_grammars", type(constraints._grammars)())
    monkeypatch.setattr(constraints, "_grammars_chars", [0])
    compiled: list[int] = []
    real = llguidance.LLMatcher

    class Counted:  # llguidance.LLMatcher, its grammar compilations counted
        def __getattr__(self, name: str) -> object:
            if name == "grammar_from_json_schema":
                compiled.append(1)
            return getattr(real, name)
    monkeypatch.setattr(llguidance, "LLMatcher", Counted())
    ab = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    ba = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    first = constraints.schema_grammar(copy.deepcopy(ab), "response_format")
    assert [constraints.schema_grammar(copy.deepcopy(ab), "x") for _ in range(5)] == [first] * 5
    assert len(compiled) == 1
    other = constraints.schema_grammar(ba, "response_format")
    assert len(compiled) == 2 and other != first
    for _ in range(2):
        with pytest.raises(APIError):
            constraints.schema_grammar({"type": "object", "properties": {"a": {"type": 7}}},
                                       "response_format")
    assert len(compiled) == 4


def test_the_kept_grammars_stay_within_their_text_budget(monkeypatch):
    """However many distinct schemas clients send, the proxy keeps at most GRAMMARS_KEPT of
    them and GRAMMARS_KEPT_CHARS of text, the least recently used going first."""
    from mlxd.proxy.core import constraints
    monkeypatch.setattr(constraints, "_grammars", type(constraints._grammars)())
    monkeypatch.setattr(constraints, "_grammars_chars", [0])
    monkeypatch.setattr(constraints, "GRAMMARS_KEPT_CHARS", 20_000)
    for i in range(60):
        constraints.schema_grammar({"type": "object", "description": "x" * 2000,
                                    "properties": {f"k{i}": {"type": "integer"}}}, "x")
        kept = constraints._grammars
        assert sum(len(k) + len(g) for k, g in kept.items()) == constraints._grammars_chars[0]
        assert constraints._grammars_chars[0] <= 20_000 and len(kept) <= constraints.GRAMMARS_KEPT
    assert 0 < len(constraints._grammars) < 60
    assert '"k59"' in next(reversed(constraints._grammars))  # the newest stays
