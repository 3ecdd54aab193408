"""What a load server lets its clients do: the parts of ``aiogguf.server._app`` that say no.

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
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from aiogguf._config import (
    FORMER_NAMES,
    SERVER_MAX_MODELS,
    SERVER_MAX_REMOTE_ADMISSIONS,
    SERVER_MAX_SHARDS,
    SERVER_REQUEST_TIMEOUT_S,
    Config,
    PipelineConfig,
    server_max_loaded_bytes,
)
from aiogguf.errors import ConfigError, GGUFError, from_os_error
from aiogguf.io.opener import FileOpener
from aiogguf.io.pagecache import resident_bytes
from aiogguf.resident._protocol import one_line
from aiogguf.server._remote import RemoteAccess

__all__ = [
    "DEFAULT_MODES",
    "HEALTH_ROUTE",
    "OPT_IN_MODES",
    "REQUEST_KEYS",
    "STATUS_ROUTE",
    "PreOpened",
    "RequestRefused",
    "ServerPolicy",
    "auth_middleware",
    "exception_line",
    "json_errors_middleware",
    "one_line",
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
        "shareable",
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
# The status page's HTML holds no data (its script asks the API, with the token), so it
# is served without one.
STATUS_ROUTE = "aiogguf-status"

logger: logging.Logger = logging.getLogger("aiogguf.server._app")


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


def exception_line(exc: BaseException) -> str:
    """An error's message (else its type's name), its lines joined with ``; ``."""
    text = str(exc) or type(exc).__name__
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


class RequestRefused(Exception):
    """A request the server will not run: its HTTP status and a one-line reason."""

    def __init__(self, reason: str, status: int = 400) -> None:
        reason = one_line(reason)
        super().__init__(reason)
        self.reason = reason
        self.status = status


@dataclass(frozen=True, slots=True)
class ServerPolicy:
    """The operator's limits on clients.

    ``token``: every route but ``/healthz`` needs ``Authorization: Bearer <token>``; None:
    no authentication. ``request_keys``/``modes``: what a request's config may set.
    ``max_models``: loads in flight and ready models together (429 beyond; default 64).
    ``max_loaded_bytes``: their file bytes, every shard's real size counted before the
    load is admitted (507 beyond; default 80% of physical memory); None: no limit.
    ``max_shards``: files of one split set (400 beyond, before any is opened).
    ``max_finished``/``finished_ttl_s``: records of ended loads kept for ``GET``, the least
    recently used dropped first. ``request_timeout_s``: a request's body must arrive
    within it (408 beyond); where ``aiogguf.server._app.serve`` runs the app, a connection
    must also send a request's head within it of connecting or of its last reply.
    ``max_connections``: open connections where ``serve`` runs the app (None: a quarter
    of the descriptor limit, at most 512); loads never take the descriptors they need.
    ``remote``: the ``https://`` and ``hf://`` names clients may load, and the addresses
    those loads may connect to (``aiogguf.server._remote``; default: none).
    ``max_remote_admissions``: remote loads whose files are being opened at once (each
    holds a thread while it waits on another server; 503 beyond).
    ``keep_alive_s``: how long a model stays once idle unless its load says otherwise
    (seconds, ``math.inf`` forever); None: the config's ``[server] keep_alive``.
    """

    token: str | None = None
    request_keys: frozenset[str] = REQUEST_KEYS
    modes: frozenset[str] = DEFAULT_MODES
    max_models: int | None = SERVER_MAX_MODELS
    max_loaded_bytes: int | None = field(default_factory=server_max_loaded_bytes)
    max_shards: int = SERVER_MAX_SHARDS
    max_finished: int = 256
    finished_ttl_s: float = 3600.0
    request_timeout_s: float = SERVER_REQUEST_TIMEOUT_S
    max_connections: int | None = None
    remote: RemoteAccess = field(default_factory=RemoteAccess)
    max_remote_admissions: int = SERVER_MAX_REMOTE_ADMISSIONS
    keep_alive_s: float | None = None

    def __post_init__(self) -> None:
        unknown = self.modes - DEFAULT_MODES - OPT_IN_MODES
        if unknown:
            raise ValueError(f"unknown load mode(s) {sorted(unknown)} in the allowed modes")
        if self.max_remote_admissions < 1:
            raise ValueError(
                f"max_remote_admissions must be >= 1, got {self.max_remote_admissions}"
            )
        for name in ("max_models", "max_loaded_bytes", "max_connections"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_shards < 1:
            raise ValueError(f"max_shards must be >= 1, got {self.max_shards}")
        if self.max_finished < 0 or self.finished_ttl_s < 0:
            raise ValueError("max_finished and finished_ttl_s must be >= 0")
        if not 0 < self.request_timeout_s < float("inf"):
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.keep_alive_s is not None and not self.keep_alive_s >= 0:
            raise ValueError(f"keep_alive_s must be >= 0 (inf: forever), got {self.keep_alive_s}")
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
    for given in overrides:
        key = FORMER_NAMES.get(given, given)
        # An unknown key is left to ``with_settings``, which says what was meant.
        if key in _ALL_KEYS and key not in policy.request_keys:
            allowed = ", ".join(sorted(policy.request_keys))
            raise RequestRefused(
                f"request config: {given!r} is not a key a request may set; allowed: {allowed}",
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
            f"request config: mode {config.load.mode} is not allowed by this server "
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
    """An opener that hands out the descriptors opened while the request was checked (as
    duplicates) for those paths, and opens any other file of the load through ``opener``.
    Owns those descriptors: ``close()`` once the load has ended (or is ready).

    Every file of a split set is opened here, beneath the roots, before the load is
    admitted: ``size_bytes`` is what they really hold (a set's first shard may hold no
    tensor at all), and the load reads exactly the files that were counted."""

    def __init__(self, opener: FileOpener, paths: Sequence[str]) -> None:
        """Open ``paths`` through ``opener`` (blocking: call it in a worker thread);
        ``paths[0]`` is the file the request named.

        Raises what ``opener.open`` raises, naming the path that failed."""
        self._opener = opener
        self.path: str = paths[0] if paths else ""
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self.size_bytes: int = 0
        # Which files these are (device, inode, size, modification time): a name may
        # stand for another file tomorrow, and that is another model.
        self.file_ids: tuple[tuple[int, int, int, int], ...] = ()
        try:
            for path in paths:
                fd = opener.open(path)
                self._fds[path] = fd
                try:
                    st = os.fstat(fd)
                    self.size_bytes += st.st_size
                    self.file_ids += ((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns),)
                except OSError as exc:
                    raise from_os_error(exc, path, None, "cannot read the file") from exc
        except BaseException:
            self.close()
            raise

    def open(self, path: str) -> int:
        """A duplicate of the descriptor opened for ``path``, or a new open of it."""
        with self._lock:
            fd = self._fds.get(path)
            if fd is not None:
                return os.dup(fd)
        return self._opener.open(path)

    def cached_bytes(self) -> int | None:
        """Bytes of the opened files in the page cache now (blocking: ``mincore`` over
        each file, a window at a time); None when that cannot be known."""
        with self._lock:
            fds = list(self._fds.values())
        total = 0
        for fd in fds:
            try:
                # The descriptor's own file, reopened through /proc: nothing an
                # attacker could have planted since.
                total += resident_bytes(f"/proc/self/fd/{fd}")
            except GGUFError:
                return None
        return total

    def close(self) -> None:
        """Close the descriptors opened for the request."""
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def auth_middleware(token: str) -> Callable[[web.Request, _Handler], Awaitable[Any]]:
    """Every route but ``/healthz`` and the status page's HTML needs
    ``Authorization: Bearer <token>``."""
    expected = token.encode()

    @web.middleware
    async def authenticate(request: web.Request, handler: _Handler) -> web.StreamResponse:
        if request.match_info.route.name in (HEALTH_ROUTE, STATUS_ROUTE):
            return await handler(request)
        header = request.headers.get("Authorization", "")
        if not header.isascii():
            # aiohttp hands undecodable bytes on as surrogates, which no token holds.
            raise RequestRefused("the Authorization header must be ASCII")
        scheme, _, given = header.partition(" ")
        # Constant time: how much of a guess matched must not show in the reply's timing.
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
            return web.json_response(
                {"error": "a valid 'Authorization: Bearer <token>' header is required"},
                status=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await handler(request)

    return authenticate


# Raised by a request's own bytes, not by a bug: too deep a JSON document, text that
# does not decode. Answered 400 like any malformed request.
_MALFORMED = (RecursionError, UnicodeError)


@web.middleware
async def json_errors_middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """Every error reply as JSON, ``{"error": "one line"}``: aiohttp's own (unknown route,
    wrong method, body too large), a ``RequestRefused`` from any middleware or handler,
    and any other exception, which is a 500 and one line in the log (its traceback only
    when the ``aiogguf.server._app`` logger is at DEBUG: ``aiogguf serve --debug``)."""
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
        return web.json_response({"error": one_line(reason)}, status=exc.status, headers=headers)
    except RequestRefused as exc:
        return web.json_response({"error": exc.reason}, status=exc.status)
    except _MALFORMED as exc:
        _log_one_line(request, exc, "refused")
        return web.json_response({"error": f"malformed request: {type(exc).__name__}"}, status=400)
    except Exception as exc:
        _log_one_line(request, exc, "failed")
        return web.json_response(
            {"error": f"internal error ({type(exc).__name__}); see the server's log"},
            status=500,
        )


def _log_one_line(request: web.Request, exc: BaseException, what: str) -> None:
    # The request line is the client's: cut and on one line, so no client can write
    # lines of its own into the log.
    target = " ".join(f"{request.method} {request.rel_url}"[:200].split())
    text = " ".join(str(exc).split())[:300]
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s %s: %s: %s", target, what, type(exc).__name__, text, exc_info=exc)
    else:
        logger.error("%s %s: %s: %s", target, what, type(exc).__name__, text)
