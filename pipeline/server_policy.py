"""What a load server lets its clients do: the parts of ``aiogguf.server`` that say no.

* ``ServerPolicy``: the operator's limits (token, request keys and modes, models and bytes
  held, records kept), fixed when the application is made.
* ``request_config``: a client's ``config`` object checked against the policy and applied
  on top of the server's own config, which caps every pipeline value.
* ``PreOpened``: a load's first file, opened (under the roots) while the request was
  checked, handed to the load so that it reads that very file.
* Middlewares: bearer-token authentication, and JSON bodies for every error reply,
  aiohttp's own 404/405/413 included.
"""

from __future__ import annotations

import hmac
import os
import threading
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from aiogguf.config import Config, PipelineConfig
from aiogguf.errors import ConfigError, from_os_error
from aiogguf.io.opener import FileOpener

__all__ = [
    "DEFAULT_MODES",
    "HEALTH_ROUTE",
    "OPT_IN_MODES",
    "REQUEST_KEYS",
    "PreOpened",
    "RequestRefused",
    "ServerPolicy",
    "auth_middleware",
    "json_errors_middleware",
    "request_config",
    "server_base_config",
]

# What a client may set in a request's ``config``: where tensors go, the mode, the checks,
# laziness. Reader counts, chunk sizes, queues and devices are the operator's
# (``request_keys=`` adds to this set; the values stay capped by the server's config).
REQUEST_KEYS: frozenset[str] = frozenset(
    {
        "mode",
        "check_tensors",
        "keep_invalid",
        "lazy",
        "lazy_min_bytes",
        "prefetch",
        "n_gpu_layers",
        "split_mode",
        "main_gpu",
        "tensor_split",
        "no_host",
        "override",
    }
)
# Modes a request may ask for unless the operator allows more. ``mlock`` pins RAM for as
# long as the model lives, ``direct`` asks for O_DIRECT on the operator's disks.
DEFAULT_MODES: frozenset[str] = frozenset({"auto", "none", "mmap"})
OPT_IN_MODES: frozenset[str] = frozenset({"mlock", "direct"})

HEALTH_ROUTE = "aiogguf-healthz"

# Every key a request's config could name: those not in the policy's set are refused.
_ALL_KEYS: frozenset[str] = frozenset(
    {
        *(
            key
            for section in ("load", "placement", "pipeline")
            for key in Config().to_dict()[section]
        ),
        "sim_gpus",
        "device",
    }
)


class RequestRefused(Exception):
    """A request the server will not run: its HTTP status and a one-line reason."""

    def __init__(self, reason: str, status: int = 400) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


@dataclass(frozen=True, slots=True)
class ServerPolicy:
    """The operator's limits on clients.

    ``token``: every route but ``/healthz`` needs ``Authorization: Bearer <token>``; None:
    no authentication. ``request_keys``/``modes``: what a request's config may set.
    ``max_models``: loads in flight and ready models together (429 beyond). ``max_loaded_bytes``:
    file bytes of those (507 beyond). ``max_finished``/``finished_ttl_s``: records of ended
    loads kept for ``GET``, the least recently used dropped first.
    """

    token: str | None = None
    request_keys: frozenset[str] = REQUEST_KEYS
    modes: frozenset[str] = DEFAULT_MODES
    max_models: int | None = None
    max_loaded_bytes: int | None = None
    max_finished: int = 256
    finished_ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        unknown = self.modes - DEFAULT_MODES - OPT_IN_MODES
        if unknown:
            raise ValueError(f"unknown load mode(s) {sorted(unknown)} in the allowed modes")
        for name in ("max_models", "max_loaded_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_finished < 0 or self.finished_ttl_s < 0:
            raise ValueError("max_finished and finished_ttl_s must be >= 0")
        if self.token is not None and not self.token:
            raise ValueError("the token is empty")


def server_base_config(config: Config) -> Config:
    """The server's own config: ``auto`` mode becomes ``none``, which copies the file.

    A model mapped from a file (``mmap``) dies with SIGBUS when the file is truncated
    under it, taking every client's models along; a copy does not depend on the file.
    """
    if config.load.mode == "auto":
        return config.with_settings({"mode": "none"})
    return config


def request_config(base: Config, overrides: Mapping[str, Any], policy: ServerPolicy) -> Config:
    """``base`` with a client's ``overrides``: only keys of ``policy.request_keys``, only
    modes of ``policy.modes``, and no pipeline value above ``base``'s. Runs in a worker
    thread: compiling a client's patterns is not the loop's work.

    Raises ``RequestRefused`` (400 or 403) saying which key and why.
    """
    for key in overrides:
        # An unknown key is left to ``with_settings``, which says what was meant.
        if key in _ALL_KEYS and key not in policy.request_keys:
            allowed = ", ".join(sorted(policy.request_keys))
            raise RequestRefused(
                f"request config: {key!r} is not a key a request may set; allowed: {allowed}",
                status=403,
            )
    try:
        config = base.with_settings(overrides, origin="request config")
    except ConfigError as exc:
        raise RequestRefused(str(exc)) from exc
    except (TypeError, ValueError) as exc:  # a JSON value of a shape no key takes
        raise RequestRefused(f"request config: {exc}") from exc
    if config.load.mode not in policy.modes and config.load.mode != base.load.mode:
        raise RequestRefused(
            f"request config: mode {config.load.mode!r} is not allowed by this server "
            f"(allowed: {', '.join(sorted(policy.modes | {base.load.mode}))})",
            status=403,
        )
    for key in PipelineConfig.model_fields:
        if key == "readers":  # "auto" stands for this machine's count
            mine, theirs = base.pipeline.reader_count(), config.pipeline.reader_count()
        else:
            mine, theirs = getattr(base.pipeline, key), getattr(config.pipeline, key)
        if isinstance(mine, int) and isinstance(theirs, int) and theirs > mine:
            raise RequestRefused(
                f"request config: {key} {theirs} is above this server's {mine}", status=403
            )
    return config


class PreOpened:
    """An opener that hands out the descriptor opened while the request was checked (as
    a duplicate) for that path, and opens any other file of the load (split shards)
    through ``opener``. Owns that descriptor: ``close()`` once the load has ended."""

    def __init__(self, opener: FileOpener, path: str) -> None:
        """Open ``path`` through ``opener`` (blocking: call it in a worker thread).

        Raises what ``opener.open`` raises."""
        self._opener = opener
        self.path = path
        fd = opener.open(path)
        self._fd: int | None = fd
        self._lock = threading.Lock()
        try:
            self.size_bytes = os.fstat(fd).st_size
        except OSError as exc:
            os.close(fd)
            raise from_os_error(exc, path, None, "cannot read the file") from exc

    def open(self, path: str) -> int:
        if path == self.path:
            with self._lock:
                if self._fd is not None:
                    return os.dup(self._fd)
        return self._opener.open(path)

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def auth_middleware(token: str) -> Callable[[web.Request, _Handler], Awaitable[Any]]:
    """Every route but ``/healthz`` needs ``Authorization: Bearer <token>``."""
    expected = token.encode()

    @web.middleware
    async def authenticate(request: web.Request, handler: _Handler) -> web.StreamResponse:
        if request.match_info.route.name == HEALTH_ROUTE:
            return await handler(request)
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        # Constant time: how much of a guess matched must not show in the reply's timing.
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
            return web.json_response(
                {"error": "a valid 'Authorization: Bearer <token>' header is required"},
                status=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await handler(request)

    return authenticate


@web.middleware
async def json_errors_middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """aiohttp's own errors (unknown route, wrong method, body too large) as JSON too."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        text = exc.text or ""
        reason = text if text and not text.startswith(f"{exc.status}:") else exc.reason
        headers = {
            k: v
            for k, v in exc.headers.items()
            if k.lower() not in ("content-type", "content-length")
        }
        return web.json_response({"error": reason}, status=exc.status, headers=headers)
