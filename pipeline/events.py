"""Progress of a load, as events: delivered to a callback and to async iterators.

Delivery never slows the load: subscribers have small bounded buffers, and an
intermediate event that does not fit is dropped (the next one carries the same totals).
The final event of a load is always delivered.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from enum import StrEnum

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

__all__ = ["Progress", "ProgressCallback", "ProgressHub", "Stage"]


class Stage(StrEnum):
    PARSE = "parse"
    PLAN = "plan"
    READ = "read"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class Progress:
    """Where a load stands. ``bytes_done`` counts tensor bytes landed in their buffers."""

    stage: Stage
    bytes_done: int
    bytes_total: int
    tensors_done: int
    tensors_total: int
    elapsed_s: float
    message: str = ""

    @property
    def fraction(self) -> float:
        return self.bytes_done / self.bytes_total if self.bytes_total else 1.0

    @property
    def gbps(self) -> float:
        return self.bytes_done / self.elapsed_s / 1e9 if self.elapsed_s > 0 else math.nan

    @property
    def final(self) -> bool:
        return self.stage in (Stage.DONE, Stage.FAILED, Stage.CANCELLED)


ProgressCallback = Callable[[Progress], None]


class ProgressHub:
    """Fans progress out to a callback and to any number of subscribers."""

    def __init__(self, callback: ProgressCallback | None = None, interval_s: float = 0.05) -> None:
        self._callback = callback
        self._interval_s = interval_s
        self._subscribers: list[MemoryObjectSendStream[Progress]] = []
        self._started = time.perf_counter()
        self._last_emit = -math.inf
        self._closed = False
        self.last: Progress | None = None

    def elapsed(self) -> float:
        return time.perf_counter() - self._started

    def subscribe(self, buffer: int = 64) -> MemoryObjectReceiveStream[Progress]:
        """A stream of this load's events; it ends after the final event."""
        send, receive = anyio.create_memory_object_stream[Progress](buffer)
        if self._closed:
            if self.last is not None:
                send.send_nowait(self.last)
            send.close()
        else:
            self._subscribers.append(send)
        return receive

    async def events(self) -> AsyncIterator[Progress]:
        async with self.subscribe() as stream:
            async for event in stream:
                yield event

    def emit(
        self,
        stage: Stage,
        bytes_done: int,
        bytes_total: int,
        tensors_done: int,
        tensors_total: int,
        message: str = "",
        *,
        force: bool = False,
    ) -> None:
        now = time.perf_counter()
        if not force and now - self._last_emit < self._interval_s:
            return
        self._last_emit = now
        event = Progress(
            stage,
            bytes_done,
            bytes_total,
            tensors_done,
            tensors_total,
            now - self._started,
            message,
        )
        self.last = event
        if self._callback is not None:
            self._callback(event)
        for send in self._subscribers:
            stats = send.statistics()
            # The last place of every buffer is kept for the final event.
            if event.final or stats.current_buffer_used < stats.max_buffer_size - 1:
                # A slow or departed subscriber never costs the load any time.
                with contextlib.suppress(
                    anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError
                ):
                    send.send_nowait(event)
        if event.final:
            self.close()

    def end(self, stage: Stage, message: str) -> None:
        """The final event of a load that did not finish: the last counts, and why."""
        last = self.last
        if last is None:
            self.emit(stage, 0, 0, 0, 0, message, force=True)
        else:
            self.emit(
                stage,
                last.bytes_done,
                last.bytes_total,
                last.tensors_done,
                last.tensors_total,
                message,
                force=True,
            )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for send in self._subscribers:
            send.close()
        self._subscribers.clear()
