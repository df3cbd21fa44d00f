"""Local security for the HTTP listeners (runs in the proxy).

The Unix socket (mode 0600) is trusted: only its owner can connect and no browser can reach it.
On TCP, a request must name a loopback Host (against DNS rebinding, where a web page's own
hostname resolves to 127.0.0.1), must not come from a browser Origin that was not allowed
(against cross-site requests from any open tab), and must carry the API key when one is set.
`/admin/*` is served on TCP only to holders of the API key.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from fnmatch import fnmatch

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from mlxd.proxy.errors import APIError

# Origins a web page cannot claim: desktop apps (Electron, Tauri, VS Code webviews) and pages
# served from this machine's own loopback (local web UIs).
DEFAULT_ORIGINS = ("app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*",
                   "http://localhost", "http://localhost:*", "https://localhost",
                   "https://localhost:*", "http://127.0.0.1", "http://127.0.0.1:*",
                   "https://127.0.0.1", "https://127.0.0.1:*", "http://[::1]", "http://[::1]:*")
OPEN_PATHS = {"/health"}  # answered without the API key: liveness probes carry no secrets


@dataclass
class AccessSettings:
    bind_host: str = "127.0.0.1"
    api_key: str | None = None
    allowed_hosts: list[str] = field(default_factory=list)
    cors_origins: list[str] = field(default_factory=list)

    @property
    def loopback_only(self) -> bool:
        return is_loopback_name(self.bind_host)


@functools.lru_cache(maxsize=256)  # asked on every TCP request, of a handful of names
def is_loopback_name(host: str) -> bool:
    host = host.strip("[]").lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_without_port(value: str) -> str:
    value = value.strip()
    if value.startswith("["):  # [::1]:8080
        return value[1:value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        return value.rsplit(":", 1)[0]
    return value


def on_unix_socket(request: web.Request) -> bool:
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    return sock is not None and sock.family == socket.AF_UNIX


def origin_allowed(origin: str, settings: AccessSettings) -> bool:
    allowed = (*DEFAULT_ORIGINS, *settings.cors_origins)
    return any(pattern == "*" or fnmatch(origin.lower(), pattern.lower()) for pattern in allowed)


def presented_key(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.headers.get("x-api-key")


def check(request: web.Request, settings: AccessSettings) -> None:
    """Raises APIError (403 or 401) for a TCP request that must not be served."""
    if on_unix_socket(request):
        return
    host = request.headers.get("Host")
    if settings.loopback_only and host is not None:
        name = host_without_port(host)
        if not is_loopback_name(name) and name.lower() not in (
                h.lower() for h in settings.allowed_hosts):
            raise APIError(403, f"Host {host!r} is not a loopback name; add it with "
                                "--allowed-host if this is intended", type="permission_error",
                           code="host_not_allowed")
    origin = request.headers.get("Origin")
    if origin is not None and not origin_allowed(origin, settings):
        raise APIError(403, f"browser Origin {origin!r} is not allowed; allow it with "
                            "--cors-origin", type="permission_error", code="origin_not_allowed")
    if request.method == "OPTIONS":
        return  # a preflight carries no credentials; answered by the CORS handler
    key_ok = settings.api_key is not None and hmac.compare_digest(
        (presented_key(request) or "").encode(), settings.api_key.encode())
    if settings.api_key is not None and not key_ok and request.path not in OPEN_PATHS:
        raise APIError(401, "missing or wrong API key: send `Authorization: Bearer KEY` or "
                            "`x-api-key: KEY`", type="authentication_error",
                       code="invalid_api_key")
    if request.path.startswith("/admin/") and not key_ok:
        raise APIError(403, "/admin/* is served on the Unix socket, or on TCP with --api-key",
                       type="permission_error", code="admin_not_allowed")


def middleware(settings: AccessSettings) -> Middleware:
    @web.middleware
    async def access_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        check(request, settings)
        origin = request.headers.get("Origin")
        if request.method == "OPTIONS" and origin is not None:
            return web.Response(status=204, headers=_cors_headers(request, origin, preflight=True))
        return await handler(request)
    return access_middleware


def _cors_headers(request: web.Request, origin: str, preflight: bool = False) -> dict[str, str]:
    headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
    if preflight:
        headers["Access-Control-Allow-Methods"] = "GET, POST, DELETE, OPTIONS"
        headers["Access-Control-Allow-Headers"] = request.headers.get(
            "Access-Control-Request-Headers", "authorization, content-type, x-api-key")
        headers["Access-Control-Max-Age"] = "600"
    return headers


def cors_signal(settings: AccessSettings
                ) -> Callable[[web.Request, web.StreamResponse], Awaitable[None]]:
    async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
        """on_response_prepare: an allowed Origin may read the response (streams included)."""
        origin = request.headers.get("Origin")
        if (origin is not None and "Access-Control-Allow-Origin" not in response.headers
                and origin_allowed(origin, settings)):
            response.headers.update(_cors_headers(request, origin))
    return add_cors_headers
