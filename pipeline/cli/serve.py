"""`aiogguf serve`: run the HTTP load server alone (on uvloop when it is installed).

Routes and states are described in ``aiogguf.server``. Stops on SIGINT or SIGTERM,
cancelling every load and closing every model first.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence
from typing import Any

from aiogguf.units import parse_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s)"
    )
    parser.add_argument(
        "--port", type=int, default=8765, help="port; 0 picks a free one (default: %(default)s)"
    )
    parser.add_argument("--config", metavar="FILE", help="TOML file: the base of every load")
    parser.add_argument(
        "--root",
        action="append",
        metavar="DIR",
        help="serve only files under DIR (repeatable; default: any readable path)",
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


def run(args: argparse.Namespace) -> int:
    # aiohttp is the optional ``server`` extra: imported only when serving.
    try:
        from aiogguf.server import LoadLimiter, create_app, serve
    except ImportError as exc:
        print(
            f"aiogguf serve: needs aiohttp (pip install 'aiogguf[server]'): {exc}",
            file=sys.stderr,
        )
        return 1
    from aiogguf.api import run as run_loop

    try:
        limiter = LoadLimiter(args.max_loads, args.max_readers, parse_size(args.max_staging))
    except ValueError as exc:
        print(f"aiogguf serve: {exc}", file=sys.stderr)
        return 2
    app = create_app(config=args.config, limiter=limiter, roots=args.root)

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
