"""Optional parts of the CLI: the commands that need the harness (``aiogguf.testing``)
import it when they run, so ``aiogguf inspect`` and the loader never need ``gguf``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["DEMO_INSTALL", "MissingExtraError", "needs_demo_extra"]

DEMO_INSTALL = "pip install 'aiogguf[demo]'"


class MissingExtraError(Exception):
    """An optional dependency of one command is not installed; the message says how to
    install it. The CLI prints it as one line and exits 2."""


@contextmanager
def needs_demo_extra(what: str) -> Iterator[None]:
    """Turn a missing ``gguf`` inside the block into ``MissingExtraError``.

    ``what``: what needs it, for the message ("the synthetic model").
    Raises ``MissingExtraError``: ``gguf`` could not be imported inside the block.
    """
    try:
        yield
    except ModuleNotFoundError as exc:
        # Only gguf itself: a missing module anywhere else is a broken install, not an extra.
        if exc.name != "gguf" and not (exc.name or "").startswith("gguf."):
            raise
        raise MissingExtraError(
            f"{what} is written with the gguf package, which is not installed: {DEMO_INSTALL}"
        ) from exc
