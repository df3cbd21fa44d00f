"""Random JSON schemas of the kinds clients send for structured output and tool arguments:
objects (required and optional keys, nested), arrays (nested, with and without item bounds),
enums, integers and numbers (with and without bounds), strings (with and without length
bounds), booleans. Deterministic for a seed. Used by tests/test_budget_closing.py and
benchmarks/budget_closing.py."""

from __future__ import annotations

import random
from typing import Any

_WORDS = ["id", "name", "city", "tags", "score", "items", "kind", "ok", "count", "note",
          "level", "unit", "price", "when", "owner", "parts", "label", "size", "x", "values"]


def random_schema(seed: int, depth: int = 3) -> dict[str, Any]:
    """A closed object schema (what the proxy's grammars use: additionalProperties false)."""
    return _object(random.Random(seed), depth)


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    keys = rng.sample(_WORDS, rng.randint(1, 5))
    props = {k: _value(rng, depth - 1) for k in keys}
    required = [k for k in keys if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "integer", "number", "boolean", "enum"]
    if depth > 0:
        kinds += ["object", "array", "array"]
    kind = rng.choice(kinds)
    if kind == "object":
        return _object(rng, depth)
    if kind == "array":
        s: dict[str, Any] = {"type": "array", "items": _value(rng, depth - 1)}
        if rng.random() < 0.5:
            s["minItems"] = rng.randint(0, 3)
        if rng.random() < 0.4:
            s["maxItems"] = s.get("minItems", 0) + rng.randint(0, 4)
        return s
    if kind == "string":
        s = {"type": "string"}
        if rng.random() < 0.4:
            s["minLength"] = rng.randint(0, 12)
        if rng.random() < 0.4:
            s["maxLength"] = s.get("minLength", 0) + rng.randint(0, 20)
        return s
    if kind in ("integer", "number"):
        s = {"type": kind}
        if rng.random() < 0.5:
            s["minimum"] = rng.randint(-50, 500)
        if rng.random() < 0.4:
            s["maximum"] = s.get("minimum", 0) + rng.randint(0, 10000)
        return s
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "celsius", "fahrenheit", "UTC",
                                    "a", "north-west", "x y z"], rng.randint(1, 4))}
    return {"type": "boolean"}
