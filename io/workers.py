"""Threads of a load's own for its blocking work, at a lower CPU priority.

On a machine with few cores, threads that copy or scan gigabytes keep every core busy;
the event loop's thread then waits for a core whenever it wakes up, and the server that
embeds the load answers late. These threads run at a higher ``nice`` value than the rest
of the process, so the scheduler hands the loop's thread a core first; throughput is
unchanged when the loop is idle. (anyio's shared worker threads are not reniced: they
run the embedding application's work too, and an unprivileged process may not lower a
thread's nice value again.)

Every blocking call of a load runs here: parsing, planning, opening, allocating,
reading, checking, uploading and closing. ``LoadThreads(n)`` lends a load ``n`` threads
for as long as its ``async with`` lasts. The threads themselves come from a process-wide
pool and go back to it afterwards, so a load in a process that has loaded before starts
no thread; a thread idle for ``IDLE_S`` ends. New threads are started by the pool's own
starter thread, never by the loop's (``reserve_threads`` asks for them ahead).

A thread takes its next call from a queue as soon as it is free, and hands its result to
the loop without waiting for the loop to take it: with more calls submitted than threads,
no thread waits for the loop thread, which on a busy 2-core machine may itself be waiting
for a core (anyio's worker threads get every call through the loop).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from types import TracebackType
from typing import Any, Generic, TypeVar

import anyio
import anyio.lowlevel

__all__ = [
    "IDLE_NAME",
    "IDLE_S",
    "LOAD_NICE",
    "LoadThreads",
    "at_load_priority",
    "idle_threads",
    "reserve_threads",
]

T = TypeVar("T")

# How much less CPU weight the threads get: nice 5 is about a third of the loop's weight.
LOAD_NICE = 5
# A pooled thread with nothing to do for this long ends.
IDLE_S = 60.0
# What a pooled thread is called while no load holds it (not "aiogguf-…": a thread
# named so is doing a load's work).
IDLE_NAME = "idle aiogguf thread"


def at_load_priority() -> None:
    """Lower the calling thread's CPU priority to ``LOAD_NICE`` (a hint only: containers
    may forbid it)."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOAD_NICE)


@dataclass(slots=True)
class _Call(Generic[T]):
    fn: Callable[[], T]
    done: anyio.Event = field(default_factory=anyio.Event)
    value: T | None = None
    error: BaseException | None = None


class _Worker:
    """One pooled OS thread. Between loads it waits on its inbox for the next lane to
    serve (a ``LoadThreads``' queue), then for ``IDLE_S`` at most."""

    def __init__(self, pool: _Pool, number: int) -> None:
        self._pool = pool
        # A lane to serve; what it returns is run once the worker is back in the pool.
        self.inbox: queue.SimpleQueue[Callable[[], Callable[[], None] | None]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"{IDLE_NAME} {number}", daemon=True)
        self.number = number

    def _run(self) -> None:
        at_load_priority()
        self._pool.start_promised_starter()
        while True:
            try:
                serve = self.inbox.get(timeout=IDLE_S)
            except queue.Empty:
                if self._pool.retire(self):
                    return
                continue  # taken just now: its lane is on the way
            then = serve()
            self.thread.name = f"{IDLE_NAME} {self.number}"
            # Back in the pool before the lane's owner hears of it, so that a load
            # that starts right after this one finds the thread.
            kept = self._pool.give_back(self)
            if then is not None:
                then()
            if not kept:
                return


class _Pool:
    """The process's idle load threads, most recently used last, and the one thread
    that starts new ones.

    Starting a thread blocks its starter until the new thread runs, which on a busy
    machine takes milliseconds: the loop's thread never does it. A load that needs more
    threads than are idle asks the starter and awaits them; ``reserve`` asks it ahead
    of time, without waiting. A caller starts one thread per process: the first load's
    first thread, which starts the starter.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._numbers = itertools.count()
        self._requests: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self._starter: threading.Thread | None = None
        self._starter_promised = False  # the first thread will start it

    async def take(self, count: int) -> list[_Worker]:
        """``count`` threads, idle ones first; the rest are started for the caller."""
        reused = self._take_idle(count)
        if len(reused) == count:
            return reused
        if self._first_start():
            # A process's first load: its first thread is started here, the one thread
            # start the caller ever does, and that thread starts the starter (see
            # ``_Worker._run``), so the load waits for one start, not two and a reply.
            first = _Worker(self, next(self._numbers))
            try:
                first.thread.start()
            except BaseException:
                with self._lock:
                    self._starter_promised = False  # the next caller starts the starter
                raise
            reused.append(first)
            if len(reused) == count:
                return reused
        try:
            return reused + await self._started(count - len(reused))
        except BaseException:
            for worker in reused:
                worker.inbox.put(_nothing)  # straight back to the pool
            raise

    def _take_idle(self, count: int) -> list[_Worker]:
        with self._lock:
            taken = self._idle[len(self._idle) - min(count, len(self._idle)) :]
            del self._idle[len(self._idle) - len(taken) :]
        return taken

    async def _started(self, count: int) -> list[_Worker]:
        token = anyio.lowlevel.current_token()
        done = anyio.Event()
        request = _Request(count)
        request.reply = lambda: _run_sync_soon(token, done.set, ())
        self._ask(request)
        # Shielded: threads started for a caller that left would be lost to the pool.
        with anyio.CancelScope(shield=True):
            await done.wait()
        if request.error is not None:
            raise request.error
        return request.started

    def reserve(self, count: int) -> None:
        """Have ``count`` threads idle soon, starting what is missing; returns at once."""
        self._ask(_Request(count))

    def _ask(self, request: _Request) -> None:
        self._requests.put(request)  # served once the starter runs
        with self._lock:
            if self._starter is None and not self._starter_promised:
                self._start_starter()

    def _first_start(self) -> bool:
        """Whether the caller is to start the process's first thread itself (nothing
        was ever started); that thread then starts the starter."""
        with self._lock:
            if self._starter is not None or self._starter_promised:
                return False
            self._starter_promised = True
            return True

    def start_promised_starter(self) -> None:
        """From the first thread: start the starter the first ``take`` promised. If it
        cannot be started, the requests waiting for it fail with the reason (a caller
        would wait for ever), and the next request starts it on its caller's thread."""
        with self._lock:
            if self._starter is not None or not self._starter_promised:
                return
            try:
                self._start_starter()
            except Exception as exc:
                self._starter_promised = False
                while True:
                    try:
                        request = self._requests.get_nowait()
                    except queue.Empty:
                        break
                    if request.reply is not None:
                        request.error = exc
                        request.reply()

    def _start_starter(self) -> None:
        # Under the lock.
        starter = threading.Thread(
            target=self._start_threads, name=f"{IDLE_NAME} starter", daemon=True
        )
        starter.start()
        self._starter = starter

    def _start_threads(self) -> None:
        while True:
            request = self._requests.get()
            reserving = request.reply is None
            if reserving:
                count = min(request.count, _max_idle()) - self.idle()
            else:
                # Threads a reservation started while this request waited are idle now.
                request.started = self._take_idle(request.count)
                count = request.count - len(request.started)
            try:
                for _ in range(count):
                    worker = _Worker(self, next(self._numbers))
                    worker.thread.start()
                    if reserving:
                        worker.inbox.put(_nothing)  # it puts itself in the pool
                    else:
                        request.started.append(worker)
            except BaseException as exc:  # handed to the caller (a reservation is a hint)
                request.error = exc
                for worker in request.started:
                    worker.inbox.put(_nothing)
                request.started = []
            if request.reply is not None:
                request.reply()

    def give_back(self, worker: _Worker) -> bool:
        """From the worker's thread, its lane ended: whether it stays (else it ends)."""
        with self._lock:
            if len(self._idle) >= _max_idle():
                return False
            self._idle.append(worker)
            return True

    def retire(self, worker: _Worker) -> bool:
        """From an idle worker's thread after ``IDLE_S``: whether it may end (False: a
        load took it meanwhile)."""
        with self._lock:
            if worker in self._idle:
                self._idle.remove(worker)
                return True
            return False

    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def forget(self) -> None:
        """In a forked child: the parent's threads do not exist there."""
        self._lock = threading.Lock()
        self._idle = []
        self._requests = queue.SimpleQueue()
        self._starter = None
        self._starter_promised = False


@dataclass(slots=True)
class _Request:
    """Threads asked of the starter: for a caller (``reply`` set), or a reservation."""

    count: int
    reply: Callable[[], None] | None = None
    started: list[_Worker] = field(default_factory=list)
    error: BaseException | None = None


def _nothing() -> None:
    return None


def _max_idle() -> int:
    # Enough for the busiest load a machine runs (readers, transfers and checks).
    return 4 * (os.cpu_count() or 1) + 8


_POOL = _Pool()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_POOL.forget)


def idle_threads() -> int:
    """How many pooled threads wait for a load now."""
    return _POOL.idle()


def reserve_threads(count: int) -> None:
    """Start threads in the background until ``count`` are idle (up to the pool's
    cap), so that a load about to begin finds them ready; returns at once."""
    _POOL.reserve(count)


class LoadThreads:
    """``async with LoadThreads(n) as threads: await threads.run_sync(fn, *args)``.

    ``run_sync`` returns once ``fn`` has finished — also when the caller is cancelled
    meanwhile, since ``fn`` writes into memory the caller owns — and then raises the
    cancellation. On exit every thread has gone back to the pool.
    """

    def __init__(self, count: int, *, name: str = "aiogguf-reader") -> None:
        self._count = max(count, 1)
        self._name = name
        self._queue: queue.SimpleQueue[_Call[Any] | None] = queue.SimpleQueue()
        self._workers: list[_Worker] = []
        self._token: anyio.lowlevel.EventLoopToken | None = None
        self._serving = 0
        self._all_back: anyio.Event | None = None

    @property
    def count(self) -> int:
        """How many threads run calls."""
        return self._count

    async def __aenter__(self) -> LoadThreads:
        self._token = anyio.lowlevel.current_token()
        self._all_back = anyio.Event()
        self._workers = await _POOL.take(self._count)
        self._serving = len(self._workers)
        for i, worker in enumerate(self._workers):
            worker.thread.name = f"{self._name}-{i}"
            worker.inbox.put(self._serve)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for _ in self._workers:
            self._queue.put(None)
        assert self._all_back is not None
        with anyio.CancelScope(shield=True):
            await self._all_back.wait()
        self._workers = []

    def _serve(self) -> Callable[[], None]:
        while (call := self._queue.get()) is not None:
            _running.call = call  # what ``call_soon`` from this thread reports to
            try:
                call.value = call.fn()
            except BaseException as exc:  # handed to the awaiting task, which raises it
                if call.error is None:
                    call.error = exc
            finally:
                _running.call = None
            # Scheduled, not waited for: the thread goes on to the next call at once.
            # After every ``call_soon`` of the call: the loop runs them in order.
            self._on_loop(call.done.set)
        return partial(self._on_loop, self._one_back)

    def _one_back(self) -> None:
        self._serving -= 1
        if self._serving == 0:
            assert self._all_back is not None
            self._all_back.set()

    def _on_loop(self, fn: Callable[[], object]) -> None:
        token = self._token
        assert token is not None
        _run_sync_soon(token, fn, ())

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
        """From one of the threads, within a call: run ``fn(*args)`` on the loop's thread
        soon, without waiting for it (progress reports). What ``fn`` raises, which the
        loop would only log, is raised by the ``run_sync`` of that call instead."""
        token = self._token
        assert token is not None
        call: _Call[Any] | None = getattr(_running, "call", None)

        def on_loop() -> None:
            try:
                fn(*args)
            except Exception as exc:
                if call is None:
                    raise
                if call.error is None:
                    call.error = exc

        _run_sync_soon(token, on_loop, ())


# The call each pooled thread is running, if any.
_running = threading.local()


def _run_sync_soon(
    token: anyio.lowlevel.EventLoopToken, fn: Callable[..., object], args: tuple[Any, ...]
) -> None:
    """Schedule ``fn(*args)`` on the loop of ``token`` from any thread, without waiting.
    anyio (>= 4.16) has this only on its backend class; one place uses it."""
    token.backend_class.run_sync_soon(fn, args, token.native_token)
