"""`aiogguf config show`: the effective configuration (defaults < ``--config`` file < flags),
as TOML that ``--config`` reads back, or as JSON."""

from __future__ import annotations

import argparse
import json

from aiogguf.cli.options import add_placement_options, config_from_args

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``config`` command's actions and flags."""
    sub = parser.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = sub.add_parser(
        "show",
        help="print the effective configuration",
        description="Print the configuration a load with these flags would use: the "
        "defaults, overridden by --config FILE, overridden by the flags.",
    )
    # SUPPRESS: set only when given here, so ``aiogguf config --debug show`` keeps it.
    show.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    show.add_argument("--json", action="store_true", help="print JSON (sizes in bytes)")
    add_placement_options(show)


def run(args: argparse.Namespace) -> int:
    """Print the effective configuration (TOML, or JSON with ``--json``)."""
    config = config_from_args(args)
    if args.json:
        print(json.dumps(config.to_dict(), indent=2))
        return 0
    origin = f"defaults < {config.source}" if config.source else "defaults"
    print(f"# effective configuration: {origin} < command-line flags")
    print(config.to_toml(), end="")
    return 0
