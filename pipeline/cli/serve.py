"""`aiogguf serve`: run the HTTP load server alone (on uvloop when it is installed).

Routes and states are described in ``aiogguf.server``. Stops on SIGINT or SIGTERM,
cancelling every load and closing every model first.

It refuses to start rather than serve unsafely: without ``--root`` (or ``[server] roots``)
unless ``--allow-any-path`` is given, and on an address other than loopback without
``--token-file`` unless ``--insecure`` is given; both escapes print a warning.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import sys
from collections.abc import Sequence
from typing import Any

from aiogguf.config import load_config
from aiogguf.units import parse_size

EXIT_INVALID = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
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
        "--max-models",
        type=int,
        metavar="N",
        help="models loading or ready at once; beyond: 429 (default: no limit)",
    )
    parser.add_argument(
        "--max-loaded-bytes",
        metavar="SIZE",
        help="file bytes of the models loading or ready; beyond: 507 (default: no limit)",
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


def _read_token(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise _Refused(f"--token-file {path}: cannot read: {exc}") from exc
    if not token or any(c.isspace() for c in token):
        raise _Refused(f"--token-file {path}: expected one token with no spaces")
    return token


def _checked(args: argparse.Namespace, roots: Sequence[str]) -> str | None:
    """Refuse what would make an unsafe or broken server; the token, if any."""
    if not 0 <= args.port <= 65535:
        raise _Refused(f"--port {args.port}: expected a port in 0-65535")
    for root in roots:
        if not os.path.isdir(root):
            raise _Refused(f"--root {root}: not a directory")
    if not roots and not args.allow_any_path:
        raise _Refused(
            "no --root given: name the directories clients may load from with --root DIR "
            "(or [server] roots in --config), or pass --allow-any-path"
        )
    token = _read_token(args.token_file) if args.token_file else None
    if token is None and not _is_loopback(args.host) and not args.insecure:
        raise _Refused(
            f"--host {args.host} is not a loopback address: give --token-file FILE, "
            "or pass --insecure"
        )
    for name in ("max_models", "max_loads", "max_readers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise _Refused(f"--{name.replace('_', '-')} {value}: expected at least 1")
    return token


def run(args: argparse.Namespace) -> int:
    # aiohttp is the optional ``server`` extra: imported only when serving.
    try:
        from aiogguf.server import LoadLimiter, ServerPolicy, create_app, serve
        from aiogguf.server_policy import DEFAULT_MODES
    except ImportError as exc:
        print(
            f"aiogguf serve: needs aiohttp (pip install 'aiogguf[server]'): {exc}",
            file=sys.stderr,
        )
        return 1
    from aiogguf.api import run as run_loop

    config = load_config(args.config)  # a ConfigError is one line, exit 2
    try:
        token = _checked(args, [*args.root, *config.server.roots])
        limiter = LoadLimiter(args.max_loads, args.max_readers, parse_size(args.max_staging))
        max_bytes = parse_size(args.max_loaded_bytes) if args.max_loaded_bytes else None
        policy = ServerPolicy(
            token=token,
            modes=DEFAULT_MODES | frozenset(args.allow_mode),
            max_models=args.max_models,
            max_loaded_bytes=max_bytes,
        )
    except (_Refused, ValueError) as exc:
        print(f"aiogguf serve: {exc}", file=sys.stderr)
        return EXIT_INVALID
    if args.allow_any_path and not args.root and not config.server.roots:
        print(
            "aiogguf serve: warning: --allow-any-path: clients may load any file this "
            "process can read",
            file=sys.stderr,
        )
    if token is None and not _is_loopback(args.host):
        print(
            f"aiogguf serve: warning: --insecure: anyone who reaches {args.host} may load, "
            "list and unload models",
            file=sys.stderr,
        )
    app = create_app(
        config=config,
        limiter=limiter,
        roots=args.root,
        allow_any_path=args.allow_any_path,
        policy=policy,
    )

    def started(addresses: Sequence[Any]) -> None:
        for address in addresses:
            host, port = address[0], address[1]
            shown = f"[{host}]" if ":" in host else host
            print(f"aiogguf serve: listening on http://{shown}:{port}", flush=True)

    async def main() -> None:
        await serve(app, host=args.host, port=args.port, on_started=started)

    # The loop runner turns SIGINT into cancellation first, so shutdown has run.
    with contextlib.suppress(KeyboardInterrupt):
        run_loop(main)
    print("aiogguf serve: stopped", flush=True)
    return 0
