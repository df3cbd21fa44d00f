"""Bounds on request bodies, and the one place bodies are decoded (runs in the proxy).

Every field of a request Struct has a type from here, so what reaches the file system (model
names), the engine channel (msgpack carries integers in [-2**63, 2**64)) or MLX (int32 token
counts and ids) is bounded, and a violation is a 400 naming the field. Free-form JSON (tools,
schemas, tool-call arguments, metadata) cannot be typed; `check_json` bounds its nesting depth
and integers after decoding, so nothing downstream (llguidance, json.dumps, a chat template)
can recurse away or overflow.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Annotated, Any, TypeVar

import msgspec

from mlxd.proxy import field_errors
from mlxd.proxy.errors import bad_request, invalid_field

MAX_JSON_DEPTH = 64  # nesting levels of a request body, free-form fields included
MAX_NAME_CHARS = 1024  # model names: an absolute path fits (macOS PATH_MAX)
MAX_IDENT_CHARS = 256  # roles, types, tool names, call ids, user ids
MAX_STOP_CHARS = 1024  # one stop string
MAX_COUNT = 2**31 - 1  # token counts and token ids: MLX indexes with int32
INT64_MIN, INT64_MAX, UINT64_MAX = -(2**63), 2**63 - 1, 2**64 - 1  # msgpack (the engine
# channel) carries [INT64_MIN, UINT64_MAX]; msgspec bounds a field at most to int64
MAX_SECONDS = 10 * 365 * 86400.0  # keep_alive, drain timeout
MAX_REPO_PART = 96  # a Hugging Face user, org or repo name is at most 96 characters

ModelName = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
Ident = Annotated[str, msgspec.Meta(max_length=MAX_IDENT_CHARS)]
StopString = Annotated[str, msgspec.Meta(max_length=MAX_STOP_CHARS)]
TokenCount = Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
TopK = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
SmallInt = Annotated[int, msgspec.Meta(ge=-MAX_COUNT, le=MAX_COUNT)]  # checked further in code
Seed = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
Seconds = Annotated[float, msgspec.Meta(ge=-MAX_SECONDS, le=MAX_SECONDS)]
Duration = Annotated[str, msgspec.Meta(max_length=32)]  # "5m", "1h", "-1"

T = TypeVar("T")


def decode_body(body: bytes, kind: type[T]) -> T:
    """A request body as `kind`, or a 400 that says what is wrong with it."""
    if not body.strip():
        raise bad_request("the request body is empty; expected a JSON object")
    try:
        value = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise invalid_field(field_errors.parse(str(e), _plain(body))) from e
    except msgspec.DecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from e
    except RecursionError:
        raise too_deep("the request body") from None
    check_json(value)
    return value


def _plain(body: bytes) -> Any:
    """The body as plain JSON, to say what a client sent in an invalid field (None if that
    cannot be read either)."""
    try:
        return msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError, ValueError):
        return None


def too_deep(what: str) -> Exception:
    return bad_request(f"{what} nests too deeply: at most {MAX_JSON_DEPTH} levels of JSON "
                       "objects and arrays are accepted")


def loads(text: str, what: str) -> Any:
    """Client JSON inside a string field (tool-call arguments), bounded like a body."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise too_deep(what) from None
    except ValueError as e:
        raise bad_request(f"{what} is not JSON: {e}") from e
    check_json(value, what)
    return value


def check_json(value: Any, what: str = "the request body") -> None:
    """400 if `value` (decoded JSON: dicts, lists, Structs, scalars) nests deeper than
    MAX_JSON_DEPTH or holds an integer the engine channel cannot carry. Iterative: a walk
    that recursed would fail on exactly the input it is there to refuse. Runs on every
    request, so scalars are checked where they are met instead of taking a turn on the
    stack."""
    _check_scalar(value, what)
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        items: Iterable[Any]
        if isinstance(v, dict):
            items = v.values()
        elif isinstance(v, (list, tuple)):
            items = v
        elif isinstance(v, msgspec.Struct):
            items = msgspec.structs.astuple(v)
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise too_deep(what)
        for item in items:
            kind = type(item)
            if item is None or kind is str or kind is float or kind is bool:
                continue
            if isinstance(item, (dict, list, tuple, msgspec.Struct)):
                stack.append((item, depth + 1))
            else:
                _check_scalar(item, what)


def _check_scalar(v: Any, what: str) -> None:
    if isinstance(v, int) and not isinstance(v, bool) and not INT64_MIN <= v <= UINT64_MAX:
        raise bad_request(f"{what} holds an integer of {v.bit_length()} bits, outside "
                          "the 64-bit range")


def clip(text: str, limit: int = 200) -> str:
    """A client-supplied string as it may appear in an error message or a log line."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
