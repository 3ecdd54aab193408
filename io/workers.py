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

import _thread
import contextlib
import functools
import itertools
import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
    serve (a ``LoadThreads``' queue), then for ``IDLE_S`` at most. A lane's owner hands
    the worker back to the pool when it leaves: the worker may still be on its way out
    of that lane, and serves the next one from its inbox after it."""

    def __init__(self, pool: _Pool, number: int) -> None:
        self._pool = pool
        # Lanes to serve, in order; None ends the thread.
        self.inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=self.idle_name(number), daemon=True)
        self.number = number

    @staticmethod
    def idle_name(number: int) -> str:
        return f"{IDLE_NAME} {number}"

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
            if serve is None:
                return
            serve()


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
        # Someone has taken on starting the starter (or started it); False again if
        # that failed, so that the next request tries.
        self._starter_claimed = False
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
                    # The next caller starts the starter.
                    self._starter_claimed = self._starter_promised = False
                raise
            reused.append(first)
            if len(reused) == count:
                return reused
        try:
            return reused + await self._started(count - len(reused))
        except BaseException:
            self.give_back(reused)
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
            if self._starter_claimed:
                return
            self._starter_claimed = True
        try:
            self._start_starter()
        except BaseException:
            self._unclaim_starter()
            raise

    def _first_start(self) -> bool:
        """Whether the caller is to start the process's first thread itself (nothing
        was ever started); that thread then starts the starter."""
        with self._lock:
            if self._starter_claimed:
                return False
            self._starter_claimed = self._starter_promised = True
            return True

    def start_promised_starter(self) -> None:
        """From a new thread: start the starter if the first ``take`` promised it. If it
        cannot be started, the requests waiting for it fail with the reason (a caller
        would wait for ever), and the next request starts it on its caller's thread."""
        with self._lock:
            if not self._starter_promised:
                return
            self._starter_promised = False
        try:
            self._start_starter()
        except Exception as exc:
            # Unclaimed first: a request that comes after the queue is emptied starts
            # the starter on its caller's thread.
            self._unclaim_starter()
            while True:
                try:
                    request = self._requests.get_nowait()
                except queue.Empty:
                    break
                if request.reply is not None:
                    request.error = exc
                    request.reply()

    def _start_starter(self) -> None:
        """Start the starter (claimed by the caller), without waiting for it to run: a
        ``threading.Thread`` start waits for the new thread to take the GIL, and the
        first thread, which starts the starter, has a load's first call to make. The
        starter is no ``threading.Thread``: nothing joins it, and it never ends."""
        _thread.start_new_thread(self._start_threads, ())

    def _unclaim_starter(self) -> None:
        with self._lock:
            self._starter_claimed = False

    def _start_threads(self) -> None:
        # Registered with ``threading`` (as a dummy thread) under the idle name: it
        # works for no load.
        threading.current_thread().name = f"{IDLE_NAME} starter"
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
                        self.give_back([worker])
                    else:
                        request.started.append(worker)
            except BaseException as exc:  # handed to the caller (a reservation is a hint)
                request.error = exc
                self.give_back(request.started)
                request.started = []
            if request.reply is not None:
                request.reply()

    def give_back(self, workers: Sequence[_Worker]) -> None:
        """Workers whose lane has ended (or was never served) back into the pool,
        idle-named; past the pool's cap they end instead."""
        with self._lock:
            for worker in workers:
                worker.thread.name = worker.idle_name(worker.number)
                if len(self._idle) < _max_idle():
                    self._idle.append(worker)
                else:
                    worker.inbox.put(None)

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
        self._starter_claimed = self._starter_promised = False


@dataclass(slots=True)
class _Request:
    """Threads asked of the starter: for a caller (``reply`` set), or a reservation."""

    count: int
    reply: Callable[[], None] | None = None
    started: list[_Worker] = field(default_factory=list)
    error: BaseException | None = None


@functools.cache
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

    @property
    def count(self) -> int:
        """How many threads run calls."""
        return self._count

    async def __aenter__(self) -> LoadThreads:
        self._token = anyio.lowlevel.current_token()
        self._workers = await _POOL.take(self._count)
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
        # Every call has returned (``run_sync`` waits for its call, also when cancelled):
        # what is left in the queue are these ends, one per thread. The threads go back
        # to the pool at once, without a round trip through the loop; one that a next
        # lender takes before it has read its end serves that lender right after.
        for _ in self._workers:
            self._queue.put(None)
        _POOL.give_back(self._workers)
        self._workers = []

    def _serve(self) -> None:
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
