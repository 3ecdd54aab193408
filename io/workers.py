"""Threads of a load's own for its blocking reads and checks, at a lower CPU priority.

On a machine with few cores, threads that copy or scan gigabytes keep every core busy;
the event loop's thread then waits for a core whenever it wakes up, and the server that
embeds the load answers late. These threads run at a higher ``nice`` value than the rest
of the process, so the scheduler hands the loop's thread a core first; throughput is
unchanged when the loop is idle. The threads belong to one load: started when it starts,
joined when it ends (anyio's shared worker threads are not reniced: they run the
embedding application's work too, and an unprivileged process may not lower a thread's
nice value again).

A thread takes its next call from a queue as soon as it is free, and hands its result to
the loop without waiting for the loop to take it: with more calls submitted than threads,
no thread waits for the loop thread, which on a busy 2-core machine may itself be waiting
for a core (anyio's worker threads get every call through the loop).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel

__all__ = ["LoadThreads"]

T = TypeVar("T")

# How much less CPU weight the threads get: nice 5 is about a third of the loop's weight.
LOAD_NICE = 5


@dataclass(slots=True)
class _Call(Generic[T]):
    fn: Callable[[], T]
    done: anyio.Event = field(default_factory=anyio.Event)
    value: T | None = None
    error: BaseException | None = None


class LoadThreads:
    """``async with LoadThreads(n) as threads: await threads.run_sync(fn, *args)``.

    ``run_sync`` returns once ``fn`` has finished — also when the caller is cancelled
    meanwhile, since ``fn`` writes into memory the caller owns — and then raises the
    cancellation.
    """

    def __init__(self, count: int, *, nice: int = LOAD_NICE, name: str = "aiogguf-reader"):
        self._count = max(count, 1)
        self._nice = nice
        self._name = name
        self._queue: queue.SimpleQueue[_Call[Any] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._token: anyio.lowlevel.EventLoopToken | None = None

    @property
    def count(self) -> int:
        """How many threads run calls."""
        return self._count

    async def __aenter__(self) -> LoadThreads:
        self._token = anyio.lowlevel.current_token()
        for i in range(self._count):
            thread = threading.Thread(target=self._work, name=f"{self._name}-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for _ in self._threads:
            self._queue.put(None)
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._join)

    def _join(self) -> None:
        for thread in self._threads:
            thread.join()
        self._threads.clear()

    async def run_sync(
        self, fn: Callable[..., T], *args: Any, on_cancel: Callable[[], None] | None = None
    ) -> T:
        """Run ``fn(*args)`` on one of the threads; its result, or its exception.

        ``on_cancel``: called on the loop's thread if the caller is cancelled while ``fn``
        runs, to ask a long-running ``fn`` to return early (it is still waited for)."""
        call: _Call[T] = _Call(lambda: fn(*args))
        self._queue.put(call)
        if on_cancel is None:
            with anyio.CancelScope(shield=True):
                await call.done.wait()
        else:
            try:
                await call.done.wait()
            except anyio.get_cancelled_exc_class():
                on_cancel()
                with anyio.CancelScope(shield=True):
                    await call.done.wait()
                raise
        await anyio.lowlevel.checkpoint_if_cancelled()
        if call.error is not None:
            raise call.error
        return call.value  # type: ignore[return-value]

    def call_soon(self, fn: Callable[..., object], *args: Any) -> None:
        """From one of the threads: run ``fn(*args)`` on the loop's thread soon, without
        waiting for it (progress reports)."""
        token = self._token
        assert token is not None
        _run_sync_soon(token, fn, args)

    def _work(self) -> None:
        with contextlib.suppress(OSError):  # a hint only: containers may forbid it
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
        while (call := self._queue.get()) is not None:
            try:
                call.value = call.fn()
            except BaseException as exc:  # handed to the awaiting task, which raises it
                call.error = exc
            # Scheduled, not waited for: the thread goes on to the next call at once.
            token = self._token
            assert token is not None
            _run_sync_soon(token, call.done.set, ())


def _run_sync_soon(
    token: anyio.lowlevel.EventLoopToken, fn: Callable[..., object], args: tuple[Any, ...]
) -> None:
    """Schedule ``fn(*args)`` on the loop of ``token`` from any thread, without waiting.
    anyio (>= 4.16) has this only on its backend class; one place uses it."""
    token.backend_class.run_sync_soon(fn, args, token.native_token)
