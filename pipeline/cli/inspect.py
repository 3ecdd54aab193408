"""`aiogguf inspect` (not built yet)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("args", nargs="*")


def run(args: argparse.Namespace) -> int:
    raise NotImplementedError("aiogguf inspect is not built yet")
