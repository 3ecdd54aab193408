"""The budget a load server's concurrent loads share (``LoadLimiter``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio

__all__ = ["LimiterStats", "LoadLimiter"]


@dataclass(frozen=True, slots=True)
class LimiterStats:
    """What the admitted loads hold, and how many loads wait."""

    loads: int
    readers: int
    staging_bytes: int
    waiting: int


class LoadLimiter:
    """A server-wide budget shared by concurrent loads: at most ``max_loads`` loads, at
    most ``max_readers`` reader threads and ``max_staging_bytes`` of staging buffers in
    use at once. A load reserves its share before it starts and returns it when it ends
    (a ready model holds no readers or staging buffers, so it holds no share either).

    Waiters are served first come, first served: a big load is not starved by small
    ones. A request larger than a whole budget is cut down to it (it then runs alone).
    """

    def __init__(
        self,
        max_loads: int = 4,
        max_readers: int = 8,
        max_staging_bytes: int = 1024**3,
    ) -> None:
        if max_loads < 1 or max_readers < 1 or max_staging_bytes < 0:
            raise ValueError(
                "LoadLimiter: expected max_loads >= 1, max_readers >= 1, "
                f"max_staging_bytes >= 0, got {max_loads}, {max_readers}, {max_staging_bytes}"
            )
        self.max_loads = max_loads
        self.max_readers = max_readers
        self.max_staging_bytes = max_staging_bytes
        self._loads = 0
        self._readers = 0
        self._staging = 0
        self._waiting = 0
        # FIFO order among waiters: only the holder of ``_turn`` checks for room. Both
        # are made on first use: a limiter may be built before the event loop runs.
        self._turn: anyio.Lock | None = None
        self._freed: anyio.Event | None = None

    def statistics(self) -> LimiterStats:
        """What the admitted loads hold now, and how many wait."""
        return LimiterStats(self._loads, self._readers, self._staging, self._waiting)

    def _fits(self, readers: int, staging_bytes: int) -> bool:
        return (
            self._loads < self.max_loads
            and self._readers + readers <= self.max_readers
            and self._staging + staging_bytes <= self.max_staging_bytes
        )

    @contextlib.asynccontextmanager
    async def reserve(self, readers: int, staging_bytes: int = 0) -> AsyncIterator[None]:
        """Hold one load's share of the budget for the ``async with`` block."""
        readers = min(max(readers, 1), self.max_readers)
        staging_bytes = min(max(staging_bytes, 0), self.max_staging_bytes)
        if self._turn is None:
            self._turn = anyio.Lock()
        self._waiting += 1
        try:
            async with self._turn:
                while not self._fits(readers, staging_bytes):
                    if self._freed is None:
                        self._freed = anyio.Event()
                    await self._freed.wait()
        finally:
            self._waiting -= 1
        self._loads += 1
        self._readers += readers
        self._staging += staging_bytes
        try:
            yield
        finally:
            self._loads -= 1
            self._readers -= readers
            self._staging -= staging_bytes
            # Wake the head waiter; it makes a fresh event if it has to wait again.
            if self._freed is not None:
                self._freed.set()
                self._freed = None
