"""Progress of a load, as events: delivered to a callback and to async iterators.

A callback runs inline, on the event loop's thread, where the load counts what landed:
the load waits while it runs, so it should only note the event and return. Intermediate
events are throttled (at most one per ``interval_s``). Async iterators never slow the
load: each has a small bounded buffer, and an intermediate event that does not fit is
dropped (the next one carries the same totals). The final event of a load is always
delivered, to both.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

__all__ = ["FanOut", "Progress", "ProgressCallback", "ProgressHub", "Stage"]

T = TypeVar("T")


class FanOut(Generic[T]):
    """Items to any number of subscribers, each with a small bounded buffer. A slow or
    departed subscriber misses intermediate items and never slows the publisher; the
    last place of every buffer is kept for the final item, which always arrives."""

    def __init__(self) -> None:
        self._subscribers: list[MemoryObjectSendStream[T]] = []
        self.closed: bool = False

    def subscribe(self, buffer: int, current: T | None = None) -> MemoryObjectReceiveStream[T]:
        """A stream of the items published from now on, starting with ``current`` (if
        given); it ends after the final item (at once, if that was already published)."""
        send, receive = anyio.create_memory_object_stream[T](buffer)
        if current is not None:
            send.send_nowait(current)
        if self.closed:
            send.close()
        else:
            self._subscribers.append(send)
        return receive

    def publish(self, item: T, *, final: bool = False) -> None:
        for send in self._subscribers:
            stats = send.statistics()
            if final or stats.current_buffer_used < stats.max_buffer_size - 1:
                with contextlib.suppress(
                    anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError
                ):
                    send.send_nowait(item)
        if final:
            self.close()

    def close(self) -> None:
        """End every subscriber's stream; later subscribers get only ``current``."""
        self.closed = True
        for send in self._subscribers:
            send.close()
        self._subscribers.clear()


class Stage(StrEnum):
    """The stage a load is in, as its progress events say it."""

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
        self._fan: FanOut[Progress] = FanOut()
        self._started = time.perf_counter()
        self._last_emit = -math.inf
        self.last: Progress | None = None

    def elapsed(self) -> float:
        """Seconds since the load began."""
        return time.perf_counter() - self._started

    def subscribe(self, buffer: int = 64) -> MemoryObjectReceiveStream[Progress]:
        """A stream of this load's events; it ends after the final event."""
        return self._fan.subscribe(buffer, self.last if self._fan.closed else None)

    async def events(self) -> AsyncIterator[Progress]:
        """This load's events, from the last one sent, until the final one."""
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
        """Record an event and send it to the callback and subscribers; at most one
        every ``interval_s`` unless ``force``."""
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
        self._fan.publish(event, final=event.final)

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
        """End every subscriber's stream."""
        self._fan.close()
