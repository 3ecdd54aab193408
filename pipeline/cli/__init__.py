"""The ``aiogguf`` command line. Each subcommand lives in its own module with
``add_arguments(parser)`` and ``run(args) -> int``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from aiogguf.cli.extras import MissingExtraError
from aiogguf.errors import GGUFError

__all__ = ["main"]

# name → (module, one-line help). Modules are imported only to build their parser.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("aiogguf.cli.demo", "write a synthetic model, load it and print the report"),
    "inspect": ("aiogguf.cli.inspect", "show a model's files, metadata and tensors"),
    "plan": ("aiogguf.cli.plan", "show where every tensor would go (dry run)"),
    "load": ("aiogguf.cli.load", "load a model with a progress bar and print the report"),
    "validate": ("aiogguf.cli.validate", "load with checks on and list every bad tensor"),
    "bench": ("aiogguf.cli.bench", "measure load throughput against this machine's limits"),
    "config": ("aiogguf.cli.config", "print the effective configuration"),
    "serve": ("aiogguf.cli.serve", "run the HTTP load server"),
}

EXIT_OK, EXIT_FAILURE, EXIT_INVALID = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiogguf", description="Load GGUF models at hardware speed."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=help_text, description=help_text)
        # SUPPRESS as default: an absent sub-level flag must not reset ``aiogguf --debug``.
        command.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
        module.add_arguments(command)
        command.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        status: int = args._module.run(args)
    except GGUFError as exc:
        if args.debug:
            raise
        print(f"aiogguf {args.command}: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except MissingExtraError as exc:
        print(f"aiogguf {args.command}: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt:
        print(f"aiogguf {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug:
            raise
        print(f"aiogguf {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return status
