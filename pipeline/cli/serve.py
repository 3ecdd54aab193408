"""`aiogguf serve`: run the HTTP load server alone (on uvloop when it is installed).

Routes and states are described in ``aiogguf.server._app``. Stops on SIGINT or SIGTERM,
cancelling every load and closing every model first.

It refuses to start rather than serve unsafely: without ``--root`` (or ``[server] roots``)
unless ``--allow-any-path`` or a remote source is given, and on an address other than
loopback without ``--token-file`` unless ``--insecure`` is given; these escapes, the remote
sources (``--allow-remote hf``, ``--allow-url-prefix``) and the internal addresses remote
loads may reach (``--allow-private-addresses``, ``--allow-network``) print a warning. What
clients may hold is bounded by default (models, their bytes, shards of a set,
connections, time to send a request); every bound has a flag.

Exit status: 0 after SIGTERM, 130 after SIGINT, 2 for a bad flag (one line), 1 when a
shutdown had to be cut short (a load blocked in a system call past the deadline).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from aiogguf._config import (
    SERVER_MAX_MODELS,
    SERVER_MAX_REMOTE_ADMISSIONS,
    SERVER_MAX_SHARDS,
    SERVER_REQUEST_TIMEOUT_S,
    load_config,
    server_max_loaded_bytes,
)
from aiogguf._units import format_bytes, parse_duration, parse_size
from aiogguf.cli.extras import needs_extra
from aiogguf.errors import AttachError

__all__ = ["SHUTDOWN_DEADLINE_S", "add_arguments", "run"]

EXIT_FAILURE, EXIT_INVALID, EXIT_INTERRUPTED = 1, 2, 130
# From the signal to the end of the process, whatever the loads are doing: the loads
# stop within a second and replies under way get 0.3 s more; past this, a load is stuck in
# the kernel and the process ends without it (the kernel frees what it held).
SHUTDOWN_DEADLINE_S = 1.6
# A token is a line; a token file of more is a wrong path (a model, a log).
_MAX_TOKEN_FILE_BYTES = 4096


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``serve`` command's flags."""
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s)"
    )
    parser.add_argument(
        "--port",
        type=int,
        default=8765,
        help="port, 0-65535; 0 picks a free one (default: %(default)s)",
    )
    parser.add_argument(
        "--config", metavar="FILE", help="TOML file: the base of every load; [server] roots"
    )
    parser.add_argument(
        "--root",
        action="append",
        default=[],
        metavar="DIR",
        help="serve only files beneath DIR (repeatable); required unless --allow-any-path",
    )
    parser.add_argument(
        "--allow-any-path",
        action="store_true",
        help="serve any file this process can read (trusted clients only)",
    )
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        help="every route but /healthz needs 'Authorization: Bearer <the token in FILE>'",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --host without --token-file",
    )
    parser.add_argument(
        "--allow-mode",
        action="append",
        default=[],
        choices=("mlock", "direct"),
        help="let requests ask for this load mode too (repeatable; default: none, mmap)",
    )
    parser.add_argument(
        "--allow-remote",
        action="append",
        default=[],
        choices=("hf",),
        help="let requests load hf://OWNER/REPO/FILE.gguf[@REV] from the hub (HF_ENDPOINT)",
    )
    parser.add_argument(
        "--allow-url-prefix",
        action="append",
        default=[],
        metavar="URL",
        help="let requests load http(s) URLs beneath URL: same scheme, host and port, the "
        "path beneath it on a '/' boundary (repeatable)",
    )
    parser.add_argument(
        "--allow-private-addresses",
        action="store_true",
        help="let remote loads connect to loopback, private, link-local and other internal "
        "addresses (refused by default: no server-side request forgery)",
    )
    parser.add_argument(
        "--allow-network",
        action="append",
        default=[],
        metavar="CIDR",
        help="let remote loads connect to addresses in this network even if internal "
        "(repeatable; e.g. 10.1.0.0/16)",
    )
    parser.add_argument(
        "--max-models",
        type=int,
        default=SERVER_MAX_MODELS,
        metavar="N",
        help="models loading or ready at once; beyond: 429 (default: %(default)s)",
    )
    parser.add_argument(
        "--max-loaded-bytes",
        metavar="SIZE",
        help="file bytes of the models loading or ready, every shard counted, copies and "
        "mapped models alike; beyond: 507 (default: 80%% of physical memory, here "
        f"{format_bytes(server_max_loaded_bytes())})",
    )
    parser.add_argument(
        "--max-shards",
        type=int,
        default=SERVER_MAX_SHARDS,
        metavar="N",
        help="files of one split set; beyond: 400, before any is opened (default: %(default)s)",
    )
    parser.add_argument(
        "--max-remote-admissions",
        type=int,
        default=SERVER_MAX_REMOTE_ADMISSIONS,
        metavar="N",
        help="remote loads whose files are being opened at once; beyond: 503, before any "
        "request is sent (default: %(default)s)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        metavar="N",
        help="open connections; past it a new one closes the oldest that has not sent a "
        "request, or gets 503 (default: a quarter of the descriptor limit, at most 512)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=SERVER_REQUEST_TIMEOUT_S,
        metavar="S",
        help="seconds a connection has to send a request's head (from connecting, or "
        "from its last reply: also the keep-alive timeout) and then its body "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--keep-alive",
        metavar="DURATION",
        help="how long a model stays once idle (its last client gone), unless its load "
        "says otherwise: '5m', '30s', '1h', 0 (at once) or -1 (forever, the default; "
        "[server] keep_alive)",
    )
    parser.add_argument(
        "--socket",
        metavar="PATH",
        help="also listen on this Unix socket for processes that attach to resident models "
        "(aiogguf.attach; created 0600, in a folder no one else may write to)",
    )
    parser.add_argument(
        "--no-http",
        action="store_true",
        help="serve the --socket only, no HTTP",
    )
    parser.add_argument(
        "--attach-user",
        action="append",
        default=[],
        metavar="USER",
        help="let USER (a name or uid) attach too, besides this server's own user (repeatable)",
    )
    parser.add_argument(
        "--attach-group",
        action="append",
        default=[],
        metavar="GROUP",
        help="let processes in GROUP (a name or gid) attach too (repeatable)",
    )
    parser.add_argument(
        "--max-loads", type=int, default=4, metavar="N", help="loads at once (default: 4)"
    )
    parser.add_argument(
        "--max-readers",
        type=int,
        default=8,
        metavar="N",
        help="reader threads of all loads together (default: 8)",
    )
    parser.add_argument(
        "--max-staging",
        default="1GiB",
        metavar="SIZE",
        help="staging buffers of all loads together (default: 1GiB)",
    )


class _Refused(Exception):
    """A flag that makes the server refuse to start: one line, exit 2."""


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def _read_token(path: str) -> tuple[str, str | None]:
    """The token in ``path``, and a warning when others may read the file.

    Opened non-blocking and checked with ``fstat`` before a byte is read: a FIFO (or a
    device) would hang the server before it listens."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise _Refused(f"--token-file {path}: cannot read: {exc.strerror or exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Refused(f"--token-file {path}: not a regular file")
        if st.st_size > _MAX_TOKEN_FILE_BYTES:
            raise _Refused(f"--token-file {path}: {st.st_size} bytes; a token file holds one token")
        data = os.read(fd, _MAX_TOKEN_FILE_BYTES + 1)
    except OSError as exc:
        raise _Refused(f"--token-file {path}: cannot read: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
    try:
        token = data.decode("ascii").strip()
    except UnicodeDecodeError as exc:
        raise _Refused(f"--token-file {path}: expected one ASCII token") from exc
    if not token or any(c.isspace() or not c.isprintable() for c in token):
        raise _Refused(f"--token-file {path}: expected one token with no spaces")
    warning = None
    if st.st_mode & 0o077:
        warning = (
            f"--token-file {path}: mode {stat.S_IMODE(st.st_mode):04o} lets others than its "
            f"owner read or change the token; chmod 600 {path}"
        )
    return token, warning


def _checked(
    args: argparse.Namespace, roots: Sequence[str], remote: bool
) -> tuple[str, str | None] | None:
    """Refuse what would make an unsafe or broken server; the token, if any, with a
    warning about its file. ``remote``: remote names are allowed (no root is needed)."""
    if not 0 <= args.port <= 65535:
        raise _Refused(f"--port {args.port}: expected a port in 0-65535")
    for root in roots:
        if not os.path.isdir(root):
            raise _Refused(f"--root {root}: not a directory")
    if not roots and not args.allow_any_path and not remote:
        raise _Refused(
            "no --root given: name the directories clients may load from with --root DIR "
            "(or [server] roots in --config), pass --allow-any-path, or allow remote "
            "sources (--allow-remote hf, --allow-url-prefix URL)"
        )
    token = _read_token(args.token_file) if args.token_file else None
    if token is None and not _is_loopback(args.host) and not args.insecure:
        raise _Refused(
            f"--host {args.host} is not a loopback address: give --token-file FILE, "
            "or pass --insecure"
        )
    for name in (
        "max_models",
        "max_loads",
        "max_readers",
        "max_shards",
        "max_remote_admissions",
        "max_connections",
    ):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise _Refused(f"--{name.replace('_', '-')} {value}: expected at least 1")
    return token


def run(args: argparse.Namespace) -> int:
    """Serve loads over HTTP until interrupted."""
    # aiohttp is the optional ``server`` extra: imported only when serving.
    with needs_extra("the server", "aiohttp"):
        from aiogguf.server._app import LoadLimiter, RemoteAccess, ServerPolicy, create_app, serve
        from aiogguf.server._attach import AttachAccess
        from aiogguf.server._policy import DEFAULT_MODES
    from aiogguf._run import run as run_loop

    config = load_config(args.config)  # a ConfigError is one line, exit 2
    try:
        remote = RemoteAccess.from_config(config.server).merged(
            RemoteAccess.from_settings(
                allow_remote=args.allow_remote,
                url_prefixes=args.allow_url_prefix,
                private_addresses=args.allow_private_addresses,
                networks=args.allow_network,
            )
        )
        checked = _checked(args, [*args.root, *config.server.roots], remote.enabled)
        token, token_warning = checked if checked is not None else (None, None)
        socket_path = args.socket or config.server.socket
        if args.no_http and socket_path is None:
            raise _Refused("--no-http needs --socket PATH (or [server] socket)")
        attach = AttachAccess.from_names(
            [*config.server.attach_users, *args.attach_user],
            [*config.server.attach_groups, *args.attach_group],
        )
        limiter = LoadLimiter(args.max_loads, args.max_readers, _size(args.max_staging))
        max_bytes = (
            _size(args.max_loaded_bytes)
            if args.max_loaded_bytes is not None
            else server_max_loaded_bytes()
        )
        keep_alive_s = None
        if args.keep_alive is not None:
            try:
                keep_alive_s = parse_duration(args.keep_alive)
            except ValueError as exc:
                raise _Refused(f"--keep-alive: {exc}") from exc
        policy = ServerPolicy(
            keep_alive_s=keep_alive_s,
            token=token,
            modes=DEFAULT_MODES | frozenset(args.allow_mode),
            max_models=args.max_models,
            max_loaded_bytes=max_bytes,
            max_shards=args.max_shards,
            max_remote_admissions=args.max_remote_admissions,
            max_connections=args.max_connections,
            request_timeout_s=args.request_timeout,
            remote=remote,
        )
    except (_Refused, ValueError) as exc:
        print(f"aiogguf serve: {exc}", file=sys.stderr)
        return EXIT_INVALID
    if token_warning is not None:
        print(f"aiogguf serve: warning: {token_warning}", file=sys.stderr)
    if args.allow_any_path and not args.root and not config.server.roots:
        print(
            "aiogguf serve: warning: --allow-any-path: clients may load any file this "
            "process can read",
            file=sys.stderr,
        )
    for line in remote.warnings():
        print(f"aiogguf serve: warning: {line}", file=sys.stderr)
    if token is None and not _is_loopback(args.host):
        print(
            f"aiogguf serve: warning: --insecure: anyone who reaches {args.host} may load, "
            "list and unload models",
            file=sys.stderr,
        )
    _log_to_stderr(debug=args.debug)
    app = create_app(
        config=config,
        limiter=limiter,
        roots=args.root,
        allow_any_path=args.allow_any_path,
        policy=policy,
    )

    def started(addresses: Sequence[Any]) -> None:
        if socket_path is not None:
            print(f"aiogguf serve: attach socket {os.path.abspath(socket_path)}", flush=True)
        for address in addresses:
            host, port = address[0], address[1]
            shown = f"[{host}]" if ":" in host else host
            print(f"aiogguf serve: listening on http://{shown}:{port}", flush=True)

    received: list[int] = []

    async def main() -> None:
        signum = await serve(
            app,
            host=args.host,
            port=args.port,
            on_started=started,
            on_stopping=_deadline,
            socket_path=socket_path,
            attach=attach,
            http=not args.no_http,
        )
        if signum is not None:
            received.append(signum)

    # The loop runner turns SIGINT into cancellation first, so shutdown has run; a SIGINT
    # before ``serve`` installs its handler comes out of the runner as KeyboardInterrupt.
    try:
        run_loop(main)
    except KeyboardInterrupt:
        received.append(signal.SIGINT)
    except AttachError as exc:  # the socket cannot be made safely: the operator's to fix
        print(f"aiogguf serve: {exc}", file=sys.stderr)
        return EXIT_INVALID
    print("aiogguf serve: stopped", flush=True)
    if received == [signal.SIGINT]:
        # As every command says it, whether Ctrl-C came before or after the server listened.
        print("aiogguf serve: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    return 0


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise _Refused(str(exc)) from exc


def _deadline(signum: int) -> None:
    """From the signal on, the process ends within ``SHUTDOWN_DEADLINE_S``: a daemon
    thread ends it then if the shutdown has not (a load's thread blocked in the kernel
    holds the interpreter at exit, since load threads are not daemons)."""
    began = time.monotonic()

    def watchdog() -> None:
        time.sleep(SHUTDOWN_DEADLINE_S)
        print(
            f"aiogguf serve: the shutdown took more than {time.monotonic() - began:.1f} s "
            "(a load blocked in a system call); ending the process",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(EXIT_FAILURE)

    threading.Thread(target=watchdog, name="aiogguf-shutdown", daemon=True).start()


class _OneLineFormatter(logging.Formatter):
    """A record on one line: an exception it carries becomes ``: Type: message``, its
    traceback left out (``--debug`` keeps it). Client bytes never make log lines."""

    def format(self, record: logging.LogRecord) -> str:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None:
            return " ".join(super().format(record).split())
        plain = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None})
        text = f"{super().format(plain)}: {type(exc).__name__}: {exc}"
        return " ".join(text.split())


def _log_to_stderr(*, debug: bool) -> None:
    """The server's log on stderr (aiogguf's, aiohttp's and the event loop's), one line
    per event; tracebacks only with ``--debug``."""
    handler = logging.StreamHandler(sys.stderr)
    fmt = "aiogguf serve: %(levelname)s: %(message)s"
    handler.setFormatter(logging.Formatter(fmt) if debug else _OneLineFormatter(fmt))
    for name in ("aiogguf", "asyncio", "aiohttp"):
        log = logging.getLogger(name)
        log.addHandler(handler)
        log.setLevel(logging.DEBUG if debug else logging.WARNING)
        log.propagate = False
