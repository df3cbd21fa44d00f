"""The proxy's application state (runs in the proxy): one `ProxyState` per aiohttp app, under
the one key `STATE`; handlers read `request.app[STATE].router` and so on.

This module imports its field types only for the type checker, so every other proxy module
can import it without a cycle."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from mlxd.proxy.core.volatile import VolatileLines

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from mlxd.proxy.app import ListenSettings
    from mlxd.proxy.core.generation import ResumeStats
    from mlxd.proxy.core.sampling import Defaults
    from mlxd.proxy.engines.client import EngineClient
    from mlxd.proxy.engines.router import Router
    from mlxd.proxy.metrics import RequestMetrics


@dataclass(frozen=True)
class ListeningAt:
    """Where the listeners are bound (the real port when port 0 was asked): what
    `RUN_DIR/listen.json` tells clients."""
    port: int
    host: str
    socket: str | None


@dataclass
class ProxyState:
    client: EngineClient
    router: Router
    defaults: Defaults
    listen: ListenSettings  # the listeners asked for, with the body and header limits
    metrics: RequestMetrics
    metrics_registry: CollectorRegistry
    resume_stats: ResumeStats
    resume: bool = False  # resume requests on a restarted engine (only under --isolate)
    allow_image_urls: bool = False  # fetch http(s) image URLs (--allow-image-urls)
    shutdown_timeout: float = 15.0
    stream_ping: float = 10.0  # seconds without a byte before a stream's keep-alive (0: none)
    volatile: VolatileLines = field(default_factory=lambda: VolatileLines(None))
    request_stop: Callable[[], None] = lambda: None  # POST /admin/shutdown
    started: int = field(default_factory=lambda: int(time.time()))  # wall-clock seconds
    listening: ListeningAt | None = None  # set once the listeners are up


STATE = web.AppKey("state", ProxyState)
