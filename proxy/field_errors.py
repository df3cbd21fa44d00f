"""A request body's validation error in each API's own words (runs in the proxy).

msgspec says what is wrong in its own terms ("Expected `int` >= 1 - at `$.max_tokens`");
clients show that text to people and some act on it, so it is parsed once into a `FieldError`
and worded as the API the client speaks words it: OpenAI's ("Invalid 'max_tokens': integer
below minimum value. Expected a value >= 1, but got 0 instead.", with `param` and `code`),
Anthropic's (pydantic's: "max_tokens: Input should be greater than or equal to 1"), Ollama's
(plain). Which one is picked when the error is sent, from the request's dialect."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_AT = re.compile(r" - at `\$([^`]*)`$")
_STEP = re.compile(r"\.([A-Za-z_][\w-]*)|\[(\d+)\]|\[(\.\.\.)\]")
_TYPE = re.compile(r"^Expected `([^`]+)`, got `([^`]+)`$")
_BOUND = re.compile(r"^Expected `(int|float)` (>=|>|<=|<) (-?[\d.eE+-]+)$")
_LENGTH = re.compile(r"^Expected `(str|array|object)` of length (>=|<=) (\d+)$")
_MISSING = re.compile(r"^Object missing required field `([^`]+)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `([^`]+)`$")
_ENUM = re.compile(r"^Invalid enum value (.{1,200})$")

Loc = tuple[str | int, ...]

_A = {"int": "an integer", "float": "a number", "str": "a string", "bool": "a boolean",
      "array": "an array", "object": "an object", "null": "null"}
_PYDANTIC = {"int": "a valid integer", "float": "a valid number", "str": "a valid string",
             "bool": "a valid boolean", "array": "a valid list", "object": "a valid dictionary"}
_ABOVE = {">=": False, ">": False, "<=": True, "<": True}
_WORDS = {">=": "greater than or equal to", ">": "greater than",
          "<=": "less than or equal to", "<": "less than"}


@dataclass(frozen=True)
class FieldError:
    kind: str  # "type", "bound", "length", "missing", "unknown", "enum", "other"
    loc: Loc  # where: field names and list indices ("..." for a dict key)
    expected: str = ""  # msgspec's type name(s) ("int", "str | array | null")
    got: str = ""  # the type sent ("type"), the field ("missing", "unknown")
    op: str = ""  # ">=", ">", "<=", "<" ("bound", "length")
    limit: str = ""
    raw: str = ""  # msgspec's text, for "other"
    value: Any = None  # the value sent there, when the body could be read

    @property
    def param(self) -> str | None:
        """The field as OpenAI's `param` names it: `messages[0].role`."""
        out = ""
        for step in self.loc:
            if isinstance(step, int) or step == "...":  # an index, a dict's key
                out += f"[{step}]"
            else:
                out += f".{step}" if out else step
        return out or None

    def anthropic(self) -> str:
        where = ""  # pydantic's loc: messages.0.role
        for step in self.loc:
            where += "[...]" if step == "..." else f".{step}" if where else str(step)
        what = self._pydantic()
        return f"{where}: {what}" if where else what

    def _pydantic(self) -> str:
        if self.kind == "missing":
            return "Field required"
        if self.kind == "unknown":
            return "Extra inputs are not permitted"
        if self.kind == "type":
            kinds = [_PYDANTIC.get(t, f"a valid {t}") for t in _types(self.expected)]
            return "Input should be " + " or ".join(kinds)
        if self.kind == "bound":
            return f"Input should be {_WORDS[self.op]} {self.limit}"
        if self.kind == "enum":
            return f"Input should be one of the supported values, not {self.got}"
        if self.kind == "length":
            noun = {"str": ("String", "characters"), "array": ("List", "items"),
                    "object": ("Dictionary", "items")}[self.expected]
            most = "at most" if self.op == "<=" else "at least"
            return f"{noun[0]} should have {most} {self.limit} {noun[1]}"
        return self.raw

    def openai(self) -> str:
        p = self.param or ""
        if not p:  # the body itself
            return (f"Invalid request body: expected an object, but got "
                    f"{_A.get(self.got, self.got)} instead." if self.kind == "type"
                    else f"Invalid request body: {self.raw}")
        if self.kind == "missing":
            return f"Missing required parameter: '{p}'."
        if self.kind == "unknown":
            return f"Unrecognized request argument supplied: {p}"
        if self.kind == "type":
            want = " or ".join(_A.get(t, t) for t in _types(self.expected))
            got = "a decimal number" if self.got == "float" else _A.get(self.got, self.got)
            return f"Invalid type for '{p}': expected {want}, but got {got} instead."
        if self.kind == "enum":
            return f"Invalid value for '{p}': {self.got} is not a supported value."
        sent = self._sent()
        if self.kind == "bound":
            number = "integer" if self.expected == "int" else "decimal"
            side = "above maximum" if _ABOVE[self.op] else "below minimum"
            return (f"Invalid '{p}': {number} {side} value. Expected a value {self.op} "
                    f"{self.limit}{f', but got {sent} instead' if sent else ''}.")
        if self.kind == "length":
            noun = {"str": "string", "array": "array", "object": "object"}[self.expected]
            long = self.op == "<="
            size = f", but got {_A[self.expected]} with length {len(self.value)} instead" \
                if isinstance(self.value, (str, list, dict)) else ""
            return (f"Invalid '{p}': {noun} too {'long' if long else 'short'}. Expected "
                    f"{_A[self.expected]} with {'maximum' if long else 'minimum'} length "
                    f"{self.limit}{size}.")
        return f"Invalid '{p}': {self.raw}"

    def openai_code(self) -> str | None:
        if self.kind == "missing":
            return "missing_required_parameter"
        if self.kind == "unknown":
            return "unknown_parameter"
        if self.kind == "type":
            return "invalid_type"
        if self.kind == "enum":
            return "invalid_value"
        if self.kind == "bound":
            number = "integer" if self.expected == "int" else "decimal"
            return f"{number}_{'above_max' if _ABOVE[self.op] else 'below_min'}_value"
        if self.kind == "length":
            noun = {"str": "string", "array": "array", "object": "object"}[self.expected]
            return f"{noun}_{'above_max' if self.op == '<=' else 'below_min'}_length"
        return None

    def ollama(self) -> str:
        p = self.param or "request body"
        if self.kind == "missing":
            return f"{p} is required"
        if self.kind == "unknown":
            return f"unknown field {p}"
        if self.kind == "type":
            want = " or ".join(_A.get(t, t) for t in _types(self.expected))
            return f"invalid {p}: expected {want}, got {_A.get(self.got, self.got)}"
        if self.kind == "bound":
            return f"invalid {p}: must be {_WORDS[self.op]} {self.limit}"
        if self.kind == "enum":
            return f"invalid {p}: {self.got} is not a supported value"
        if self.kind == "length":
            unit = "characters" if self.expected == "str" else "items"
            most = "at most" if self.op == "<=" else "at least"
            return f"invalid {p}: must have {most} {self.limit} {unit}"
        return f"invalid {p}: {self.raw}"

    def _sent(self) -> str:
        v = self.value
        return str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else ""


def _types(expected: str) -> list[str]:
    return [t for t in expected.split(" | ") if t != "null"] or ["null"]


def parse(message: str, body: Any = None) -> FieldError:
    """msgspec's ValidationError text as a FieldError; `body`: the request as plain JSON (or
    None), to tell OpenAI's clients what they sent."""
    at = _AT.search(message)
    loc: list[str | int] = []
    if at:
        for name, index, key in _STEP.findall(at.group(1)):
            loc.append(name if name else int(index) if index else key)
        message = message[:at.start()]
    if m := _MISSING.match(message):
        return FieldError("missing", (*loc, m[1]), got=m[1])
    if m := _UNKNOWN.match(message):
        return FieldError("unknown", (*loc, m[1]), got=m[1])
    if m := _ENUM.match(message):
        return FieldError("enum", tuple(loc), got=m[1])
    value = _at(body, loc)
    if m := _TYPE.match(message):
        return FieldError("type", tuple(loc), expected=m[1], got=m[2], value=value)
    if m := _BOUND.match(message):
        return FieldError("bound", tuple(loc), expected=m[1], op=m[2], limit=m[3], value=value)
    if m := _LENGTH.match(message):
        return FieldError("length", tuple(loc), expected=m[1], op=m[2], limit=m[3],
                          value=value)
    return FieldError("other", tuple(loc), raw=message)


def _at(body: Any, loc: list[str | int]) -> Any:
    for step in loc:
        if isinstance(step, int) and isinstance(body, list) and step < len(body):
            body = body[step]
        elif isinstance(step, str) and isinstance(body, dict) and step in body:
            body = body[step]
        else:
            return None
    return body
