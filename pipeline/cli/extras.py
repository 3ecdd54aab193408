"""Optional parts of the CLI. A command that needs an optional package imports it when it
runs, so ``aiogguf inspect`` and the loader never need ``gguf`` or ``aiohttp``; without
the package the command says which extra installs it, in one line, exit 2 (a missing
extra is the install's state, not a bug)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aiogguf._config import Config

__all__ = [
    "DEMO_INSTALL",
    "EXTRAS",
    "MissingExtraError",
    "install_hint",
    "missing_gpu_note",
    "needs_demo_extra",
    "needs_extra",
    "say_missing_gpu_extra",
]

# The module each optional extra brings (pyproject.toml's optional-dependencies) → the
# extra's name. ``torch`` is said by ``Model.torch_tensors`` itself.
EXTRAS: dict[str, str] = {
    "gguf": "demo",
    "aiohttp": "server",
    "huggingface_hub": "remote",
    "matplotlib": "plot",
    "cupy": "cuda",
    "torch": "torch",
}


def install_hint(extra: str) -> str:
    """``pip install 'aiogguf[EXTRA]'``."""
    return f"pip install 'aiogguf[{extra}]'"


DEMO_INSTALL = install_hint("demo")


class MissingExtraError(Exception):
    """An optional dependency of one command is not installed; the message says how to
    install it. The CLI prints it as one line and exits 2."""


@contextmanager
def needs_extra(what: str, module: str) -> Iterator[None]:
    """Turn a missing ``module`` (a key of ``EXTRAS``) inside the block into
    ``MissingExtraError`` naming its extra.

    ``what``: what needs it, for the message ("the server").
    Raises ``MissingExtraError``: ``module`` could not be imported inside the block.
    """
    try:
        yield
    except ModuleNotFoundError as exc:
        # Only the module itself: a missing module anywhere else is a broken install.
        if exc.name != module and not (exc.name or "").startswith(f"{module}."):
            raise
        raise MissingExtraError(
            f"{what} needs {module}, which is not installed: {install_hint(EXTRAS[module])}"
        ) from exc


@contextmanager
def needs_demo_extra(what: str) -> Iterator[None]:
    """Turn a missing ``gguf`` inside the block into ``MissingExtraError``.

    ``what``: what needs it, for the message ("the synthetic model").
    Raises ``MissingExtraError``: ``gguf`` could not be imported inside the block.
    """
    try:
        yield
    except ModuleNotFoundError as exc:
        if exc.name != "gguf" and not (exc.name or "").startswith("gguf."):
            raise
        raise MissingExtraError(
            f"{what} is written with the gguf package, which is not installed: {DEMO_INSTALL}"
        ) from exc


def missing_gpu_note(args: argparse.Namespace, config: Config) -> str | None:
    """A line for a command asked for GPU layers (``-ngl N``, N not 0) with no simulated
    GPU and without CuPy installed: every layer stays on the CPU, as llama.cpp's do
    without a GPU backend, but here the user can still install one. None otherwise."""
    layers = getattr(args, "n_gpu_layers", None)
    if layers is None or layers == 0 or config.device:
        return None
    if importlib.util.find_spec("cupy") is not None:
        return None
    return (
        f"note: -ngl {layers} asks for GPU layers, but CuPy is not installed, so every "
        f"layer is on the CPU: {install_hint('cuda')}"
    )


def say_missing_gpu_extra(args: argparse.Namespace, config: Config) -> None:
    """Print ``missing_gpu_note`` on stderr, if there is one (the output stays the
    command's: a plan's JSON, a report)."""
    note = missing_gpu_note(args, config)
    if note is not None:
        print(f"aiogguf {args.command}: {note}", file=sys.stderr)
