"""Error envelopes (each API's own: OpenAI, Anthropic, Ollama) and the exception handlers
raise to produce them; runs in the proxy. Which envelope a request gets follows from its
path."""

from __future__ import annotations

import json
import logging
import re
import traceback

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler

from mlxd.proxy.field_errors import FieldError

log = logging.getLogger("mlxd.proxy")

MAX_LOGGED_TRACEBACK = 4000  # characters of one unhandled error's log record


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 retry_after: int | None = None) -> None:
        message = _REPR.sub("<object>", message)  # a library's text may hold a repr
        super().__init__(message)
        self.status = status
        self.message = message
        # Anthropic's own words where its clients act on them: "prompt is too long: N tokens
        # > M maximum" makes Claude Code compact its context
        self.anthropic_message = too_long(message) if code == "context_length_exceeded" else None
        self.type = type
        self.code = code
        self.param = param
        self.retry_after = retry_after
        self.field_error: FieldError | None = None  # a body's field, worded per dialect

    def body(self, dialect: str = "openai") -> dict:
        fe = self.field_error
        if dialect == "anthropic":
            return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(
                self.status, "api_error" if self.status >= 500 else "invalid_request_error"),
                "message": self.anthropic_message or (fe.anthropic() if fe else self.message)}}
        if dialect == "ollama":
            return {"error": fe.ollama() if fe else self.message}
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self, dialect: str = "openai") -> web.Response:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return web.Response(status=self.status, text=json.dumps(self.body(dialect)),
                            content_type="application/json", headers=headers)


_REPR = re.compile(r"<[^<>]{1,200} at 0x[0-9a-fA-F]+>")  # "<_io.BytesIO object at 0x7f..>"

# Anthropic's documented error types by status.
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                   429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                   529: "overloaded_error"}


_TOKENS = re.compile(r"the prompt is (\d+) tokens, but this model's context is (\d+) tokens")
_CHARS = re.compile(r"\(at least (\d+) tokens\).* context of (\d+) tokens")


def too_long(message: str) -> str | None:
    """Anthropic's message for a prompt over the context, from mlxd's ("the prompt is N
    tokens, but this model's context is M tokens"; for a prompt refused by its length in
    characters, N is the fewest tokens those characters can make)."""
    m = _TOKENS.search(message) or _CHARS.search(message)
    return f"prompt is too long: {m[1]} tokens > {m[2]} maximum" if m else None


ANTHROPIC_HEADER = "anthropic-version"  # sent by every Anthropic client


def dialect_of(path: str) -> str:
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith("/api/"):
        return "ollama"
    return "openai"


def request_dialect(request: web.Request) -> str:
    """The API whose envelope a request's errors get: by path, and on `/v1/models` (which
    both OpenAI and Anthropic serve) by the `anthropic-version` header."""
    dialect = dialect_of(request.path)
    if dialect == "openai" and request.path.startswith("/v1/models") \
            and ANTHROPIC_HEADER in request.headers:
        return "anthropic"
    return dialect


def bad_request(message: str, code: str | None = None, param: str | None = None) -> APIError:
    return APIError(400, message, code=code, param=param)


def invalid_field(fe: FieldError) -> APIError:
    """A 400 for a body that does not fit its schema, worded in the request's dialect."""
    e = APIError(400, fe.openai(), code=fe.openai_code(), param=fe.param)
    e.field_error = fe
    return e


def unavailable(message: str, code: str, retry_after: int = 2) -> APIError:
    return APIError(503, message, type="server_error", code=code, retry_after=retry_after)


_STATUS_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                 405: "invalid_request_error", 413: "invalid_request_error",
                 429: "rate_limit_error"}


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error a handler raises becomes a JSON response in the endpoint's own dialect:
    never aiohttp's plain-text pages, never a traceback to the client."""
    try:
        length, limit = request.content_length, request.client_max_size
        if length is not None and length > limit:  # refused before waiting for the bytes
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=length)
        return await handler(request)
    except APIError as e:
        return e.response(request_dialect(request))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = {413: f"request body is too large (limit {request.client_max_size} bytes)",
                   404: f"no route for {request.method} {request.path[:200]}",
                   405: f"method {request.method} is not allowed on {request.path[:200]}"}.get(
            e.status, e.reason)
        return APIError(e.status, message,
                        type=_STATUS_TYPES.get(e.status, "invalid_request_error"),
                        code=None).response(request_dialect(request))
    except (HttpProcessingError, web.RequestPayloadError) as e:  # a cut-off or ill-framed body
        return APIError(400, f"the request body could not be read: {_clip(str(e), 200)}",
                        code="bad_body").response(request_dialect(request))
    except Exception as e:  # noqa: BLE001 - a bug: one bounded log record, a JSON 500
        transport = request.transport
        if isinstance(e, ConnectionError) and (transport is None or transport.is_closing()):
            log.debug("client gone during %s %s: %s", request.method, request.path[:200], e)
        else:
            log.error("unhandled error in %s %s: %s", request.method, request.path[:200],
                      _clip("".join(traceback.format_exception(e)), MAX_LOGGED_TRACEBACK))
        if request.writer.output_size > 0 and transport is not None:
            # The response has started: no status can be sent any more, so the connection
            # ends (the response below then fails to send, quietly).
            transport.close()
        return APIError(500, f"internal error ({type(e).__name__}); the server log has "
                        "details", type="server_error", code="internal_error").response(
            request_dialect(request))


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit // 2] + "\n...\n" + text[-limit // 2:]


# What an error may tell any client: no file-system paths. A model's load error names files
# (`/Users/<name>/models/.../config.json`); the API answers every TCP client, so a path in it is
# cut to its last part. The log keeps the whole message.
# an absolute path of two or more parts (POSIX; `~/` too), up to whitespace, a quote or a bracket
_PATH = re.compile(r"(?<![\w.:/])(?:~|/[^\s/'\"()\[\]{},;:]+)(?:/[^\s/'\"()\[\]{},;:]+)+/?")


def without_paths(text: str) -> str:
    """`text` with every absolute path replaced by `.../<its last part>`."""
    def last(m: re.Match[str]) -> str:
        parts = [p for p in m.group(0).split("/") if p]
        return ".../" + parts[-1] if parts else m.group(0)
    return _PATH.sub(last, text)
