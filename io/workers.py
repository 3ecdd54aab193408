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
starter thread, never by the loop's (``reserve_threads`` asks for them ahead), and no
lender waits for one to start: its calls wait in the queue the new thread will serve.

A thread takes its next call from a queue as soon as it is free, and hands its result to
the loop without waiting for the loop to take it: with more calls submitted than threads,
no thread waits for the loop thread, which on a busy 2-core machine may itself be waiting
for a core (anyio's worker threads get every call through the loop).

A call cannot be abandoned (it may write into memory the load owns), so a cancelled load
waits for its calls; to keep that wait short, a call whose awaiting task is cancelled is
*stopped*: its flag is set, and the long loops of the stages (parse, index, plan, layout,
allocation) call ``raise_if_stopped()`` every so often, which then raises ``Stopped`` out
of the call. Reads, checks and transfers stop between jobs through flags of their own.
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import functools
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar

import anyio
import anyio.lowlevel

__all__ = [
    "IDLE_NAME",
    "IDLE_S",
    "LAZY_S",
    "LOAD_NICE",
    "Call",
    "LoadThreads",
    "StopLink",
    "Stopped",
    "at_load_priority",
    "idle_threads",
    "raise_if_stopped",
    "reserve_threads",
]

T = TypeVar("T")

# How much less CPU weight the threads get: nice 5 is about a third of the loop's weight.
LOAD_NICE = 5
# A pooled thread with nothing to do for this long ends.
IDLE_S = 60.0
# How long a progress report (``call_soon(..., lazy=True)``) may wait for the loop's next
# wake-up before it asks for one itself: at most 20 wake-ups a second for reports, where
# a load on a fast machine lands a job every millisecond or so. The progress events a
# report feeds go out at most every 50 ms (``ProgressHub``) anyway.
LAZY_S = 0.05
# What a pooled thread is called while no load holds it (not "aiogguf-…": a thread
# named so is doing a load's work).
IDLE_NAME = "idle aiogguf thread"


def at_load_priority() -> None:
    """Lower the calling thread's CPU priority by ``LOAD_NICE`` from what it inherited
    (a process already run under ``nice`` keeps the difference; 19 at most), a hint
    only: containers may forbid it."""
    me = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(
            os.PRIO_PROCESS, me, min(os.getpriority(os.PRIO_PROCESS, me) + LOAD_NICE, 19)
        )


class Stopped(Exception):
    """Raised by ``raise_if_stopped`` in a call whose awaiting task was cancelled. It
    never reaches the task: that raises its own cancellation instead (a shielded
    waiter of the same call, cleaning up, may see it, and ignores it like any error)."""


@dataclass(slots=True)
class Call(Generic[T]):
    """A call submitted to ``LoadThreads``: its function, and once it has run, its value
    or error (``LoadThreads.wait`` hands them over). ``stopped`` is set (from the loop's
    thread) when the task awaiting it is cancelled."""

    fn: Callable[[], T]
    done: anyio.Event = field(default_factory=anyio.Event)
    value: T | None = None
    error: BaseException | None = None
    stopped: bool = False


def raise_if_stopped() -> None:
    """From a long loop on a load's thread: raise ``Stopped`` if the task awaiting the
    running call was cancelled (on a thread it lent, ``StopLink.run``: once the link
    stops). A no-op anywhere else (the loop's thread, a plain thread, a direct call of a
    stage), so stages call it unconditionally. About 0.1 µs: loops over tensors call it
    every few hundred items, not every one."""
    call = getattr(_running, "call", None)
    if call is not None and call.stopped:
        raise Stopped


class StopLink:
    """A load's stop lent to a plain thread that its running call starts for part of its
    work (``run``): on that thread, ``raise_if_stopped`` raises once the call is stopped
    or ``also()`` says so. Made on the lending thread, where it finds the call (a link
    made on a thread that runs another link's ``run`` stops with that link too; made
    outside a load's call, only ``also`` stops it)."""

    __slots__ = ("_also", "_lender")

    def __init__(self, also: Callable[[], bool] = lambda: False) -> None:
        self._lender: Call[Any] | StopLink | None = getattr(_running, "call", None)
        self._also = also

    @property
    def stopped(self) -> bool:
        """Whether ``raise_if_stopped`` under this link raises."""
        lender = self._lender
        return (lender is not None and lender.stopped) or self._also()

    def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the calling thread, stopped by this link's stop."""
        before = getattr(_running, "call", None)
        _running.call = self
        try:
            return fn()
        finally:
            _running.call = before


class _Lane(Protocol):
    """What a worker serves: a lender's calls (``LoadThreads``)."""

    def _serve(self) -> None: ...

    def _refuse(self, error: BaseException) -> None: ...


class _Worker:
    """One pooled OS thread. A lender offers it a lane, which it serves until the lane
    ends; between lanes it waits on its inbox, for ``IDLE_S`` at most.

    A worker exists before its thread runs: the pool's starter starts the thread, and a
    lane offered meanwhile waits in the inbox, so no lender waits for a start. A thread
    that cannot be started refuses every lane offered to it (their calls fail with the
    reason instead of waiting for ever). A lender hands the worker back to the pool when
    it leaves: the worker may still be on its way out of that lane, and serves the next
    one from its inbox after it."""

    def __init__(self, pool: _Pool, number: int) -> None:
        self._pool = pool
        self.number = number
        # Lanes to serve, in order; None ends the thread.
        self.inbox: queue.SimpleQueue[_Lane | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=self.idle_name(number), daemon=True)
        self._lock = threading.Lock()
        self.refusal: BaseException | None = None  # why its thread could not start

    @staticmethod
    def idle_name(number: int) -> str:
        return f"{IDLE_NAME} {number}"

    def offer(self, lane: _Lane) -> None:
        """Have the thread serve ``lane`` next (or refuse it, if it cannot start)."""
        with self._lock:
            refusal = self.refusal
            if refusal is None:
                self.inbox.put(lane)
                return
        lane._refuse(refusal)

    def start(self) -> None:
        """From the starter: start the thread; if that fails, ``refuse``."""
        try:
            self.thread.start()
        except Exception as exc:  # "can't start new thread": out of threads or memory
            self.refuse(exc)

    def refuse(self, error: BaseException) -> None:
        """The thread will not run: fail the lanes offered so far and from now on, and
        leave the pool's idle workers."""
        with self._lock:
            self.refusal = error
            offered = _drain(self.inbox)
        self._pool.discard(self)
        for lane in offered:
            if lane is not None:
                lane._refuse(error)

    def _run(self) -> None:
        at_load_priority()
        while True:
            try:
                lane = self.inbox.get(timeout=IDLE_S)
            except queue.Empty:
                if self._pool.retire(self):
                    return
                continue  # taken just now: its lane is on the way
            if lane is None:
                return
            lane._serve()


class _Pool:
    """The process's idle load threads, most recently used last, and the one thread
    that starts new ones.

    Starting a ``threading.Thread`` blocks its caller until the new thread runs, which
    on a busy machine takes a millisecond: no lender does it. A lender takes idle
    workers and new ones at once, without waiting; the starter (itself started without
    a wait, once per process) starts the new ones' threads, which then find their lanes
    and calls queued. ``reserve`` adds new workers to the idle ones ahead of time.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Taken from the end. A reserved worker is idle before its thread runs.
        self._idle: list[_Worker] = []
        self._numbers = itertools.count()
        self._to_start: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._starter_started = False

    def take(self, count: int) -> list[_Worker]:
        """``count`` workers, idle ones first; the threads of the rest start soon. Raises
        what keeps the starter from starting (a process out of threads)."""
        with self._lock:
            taken = self._idle[len(self._idle) - min(count, len(self._idle)) :]
            del self._idle[len(self._idle) - len(taken) :]
            new = [self._new() for _ in range(count - len(taken))]
        try:
            self._start(new)
        except BaseException:
            self.give_back(taken)
            raise
        return taken + new

    def reserve(self, count: int) -> None:
        """Have ``count`` workers idle (up to the pool's cap), adding what is missing;
        returns at once. A hint: what keeps it from starting them is not raised."""
        with self._lock:
            new = [self._new() for _ in range(min(count, _max_idle()) - len(self._idle))]
            self._idle.extend(new)
        with contextlib.suppress(Exception):
            self._start(new)

    def _new(self) -> _Worker:
        return _Worker(self, next(self._numbers))

    def _start(self, workers: Sequence[_Worker]) -> None:
        """Have the starter start ``workers``' threads, starting the starter first if
        this is the process's first start."""
        for worker in workers:
            self._to_start.put(worker)
        with self._lock:
            if self._starter_started or not workers:
                return
            self._starter_started = True
        try:
            self._start_starter()
        except Exception as exc:
            with self._lock:
                self._starter_started = False  # the next start tries again
            # No one starts the workers queued so far (these and maybe others'): each
            # refuses its lanes, and leaves the idle ones.
            for worker in _drain(self._to_start):
                worker.refuse(exc)
            raise

    def _start_starter(self) -> None:
        """Start the starter: with ``_thread``, which does not wait for the new thread
        to run. The starter is no ``threading.Thread``: nothing joins it, and it never
        ends."""
        _thread.start_new_thread(self._start_threads, ())

    def _start_threads(self) -> None:
        # Registered with ``threading`` (as a dummy thread) under the idle name: it
        # works for no load.
        threading.current_thread().name = f"{IDLE_NAME} starter"
        while True:
            self._to_start.get().start()

    def discard(self, worker: _Worker) -> None:
        """A worker whose thread will not run leaves the idle ones."""
        with self._lock:
            if worker in self._idle:
                self._idle.remove(worker)

    def give_back(self, workers: Sequence[_Worker]) -> None:
        """Workers whose lane has ended (or was never served) back into the pool,
        idle-named; past the pool's cap they end instead."""
        with self._lock:
            for worker in workers:
                if worker.refusal is not None:
                    continue  # never ran
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
        self._to_start = queue.SimpleQueue()
        self._starter_started = False


def _drain(q: queue.SimpleQueue[T]) -> list[T]:
    """What ``q`` holds now, taken off it."""
    items: list[T] = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


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
        self._queue: queue.SimpleQueue[Call[Any] | None] = queue.SimpleQueue()
        self._workers: list[_Worker] = []
        self._token: anyio.lowlevel.EventLoopToken | None = None
        self._refusal: BaseException | None = None  # a thread of the lane could not start
        # What the threads asked the loop to run (``_on_loop``), in order, and, held while
        # a wake-up of the loop that will run it is on its way, ``_woken``. No lock guards
        # them: a thread that held one could lose the GIL inside it, and the loop would
        # then wait for that thread to get the GIL back.
        self._for_loop: collections.deque[Callable[[], object]] = collections.deque()
        self._woken = threading.Lock()
        self._last_wake = 0.0  # when the last wake-up was asked for (``time.monotonic``)

    @property
    def count(self) -> int:
        """How many threads run calls."""
        return self._count

    async def __aenter__(self) -> LoadThreads:
        return self.enter(anyio.lowlevel.current_token())

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.leave()

    def enter(self, token: anyio.lowlevel.EventLoopToken) -> LoadThreads:
        """``async with`` without the loop: take the threads (from any thread) for calls
        awaited on the loop of ``token``; ``leave`` gives them back."""
        self._token = token
        self._workers = _POOL.take(self._count)
        for i, worker in enumerate(self._workers):
            worker.thread.name = f"{self._name}-{i}"
            worker.offer(self)
        return self

    def leave(self) -> None:
        """Give the threads back, once every call submitted has returned."""
        # What is left in the queue are these ends, one per thread. The threads go back
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

    def _refuse(self, error: BaseException) -> None:
        """From the starter: a thread of this lane could not start. Every call fails
        with ``error``: those queued now (a live thread may take one first) and those to
        come; none waits for a thread that will not come."""
        self._refusal = error
        self._fail_queued(error)

    def _fail_queued(self, error: BaseException) -> None:
        ends = 0
        for call in _drain(self._queue):
            if call is None:
                ends += 1  # a live thread's end: put back
                continue
            call.error = error
            self._on_loop(call.done.set)
        for _ in range(ends):
            self._queue.put(None)

    def _on_loop(self, fn: Callable[[], object], *, lazy: bool = False) -> None:
        """Have the loop's thread run ``fn`` soon, after what was asked before it.

        At most one wake-up of the loop is pending at a time: what the threads ask for
        while it is on its way runs in the same loop iteration. A wake-up costs the loop
        an iteration, with the GIL, and each of the loop's takes of the GIL can wait a
        switch interval behind a busy thread; per job, that was a cost per byte. So a
        ``lazy`` ``fn`` (a progress report) asks for no wake-up within ``LAZY_S`` of the
        last one: it runs with the next, at the latest with its call's end, which always
        wakes the loop."""
        self._for_loop.append(fn)  # atomic, as is every deque append and pop
        if lazy and time.monotonic() - self._last_wake < LAZY_S:
            return
        if self._woken.acquire(blocking=False):
            self._last_wake = time.monotonic()
            token = self._token
            assert token is not None
            _run_sync_soon(token, self._run_for_loop, ())

    def _run_for_loop(self) -> None:
        """On the loop's thread: run what was asked, in order. What the threads ask for
        meanwhile waits for the next wake-up (which they ask for: ``_woken`` is free
        again before anything runs), so that the loop's other tasks get their turn in
        between. What raises is raised once the rest has run (the loop logs it)."""
        self._woken.release()
        first: BaseException | None = None
        ran = False
        try:
            for _ in range(len(self._for_loop)):
                fn = self._for_loop.popleft()  # only this thread takes from it
                try:
                    fn()
                except Exception as exc:
                    first = first or exc
            ran = True
        finally:
            # A KeyboardInterrupt raised in the middle (a signal lands on the loop's
            # thread) leaves the rest, calls' completions among them: they run on a
            # wake-up of their own, or whoever awaits them would wait for ever.
            if not ran and self._for_loop and self._woken.acquire(blocking=False):
                token = self._token
                assert token is not None
                _run_sync_soon(token, self._run_for_loop, ())
        if first is not None:
            raise first

    async def run_sync(
        self, fn: Callable[..., T], *args: Any, on_cancel: Callable[[], None] | None = None
    ) -> T:
        """Run ``fn(*args)`` on one of the threads; its result, or its exception.

        ``on_cancel``: called on the loop's thread if the caller is cancelled while ``fn``
        runs, to ask a long-running ``fn`` to return early (it is still waited for)."""
        return await self.wait(self.submit(fn, *args), on_cancel=on_cancel)

    async def all_running(self) -> None:
        """Return once every thread of the lane has run a call: the pool starts threads
        without waiting for them, and this waits (``warm_up``, so that the first load
        finds them running). Raises the reason a thread could not start."""
        everyone = threading.Barrier(self._count)

        async def meet() -> None:
            try:
                await self.run_sync(everyone.wait)
            except BaseException:
                everyone.abort()  # the others stop waiting for a thread that will not come
                raise

        async with anyio.create_task_group() as tg:
            for _ in range(self._count):
                tg.start_soon(meet)

    def submit(self, fn: Callable[..., T], *args: Any) -> Call[T]:
        """Queue ``fn(*args)`` for one of the threads and return at once (from any
        thread); ``wait`` for it on the loop before leaving."""
        call: Call[T] = Call(lambda: fn(*args))
        self._queue.put(call)
        if self._refusal is not None:  # after the put: ``_refuse`` may run meanwhile
            self._fail_queued(self._refusal)
        return call

    async def wait(self, call: Call[T], *, on_cancel: Callable[[], None] | None = None) -> T:
        """``call``'s result, or its exception, once it has run (see ``run_sync``). If
        the caller is cancelled meanwhile, the call is stopped (``raise_if_stopped``),
        ``on_cancel`` is called, the call is still waited for, and the cancellation is
        raised."""
        try:
            await call.done.wait()
        except anyio.get_cancelled_exc_class():
            call.stopped = True
            if on_cancel is not None:
                on_cancel()
            with anyio.CancelScope(shield=True):
                await call.done.wait()
            raise
        await anyio.lowlevel.checkpoint_if_cancelled()
        if call.error is not None:
            raise call.error
        return call.value  # type: ignore[return-value]

    def call_soon(self, fn: Callable[..., object], *args: Any, lazy: bool = False) -> None:
        """From one of the threads, within a call: run ``fn(*args)`` on the loop's thread
        soon, without waiting for it (progress reports). What ``fn`` raises, which the
        loop would only log, is raised by the ``run_sync`` of that call instead.
        ``lazy``: it may wait for the loop's next wake-up, up to the call's end
        (``_on_loop``)."""
        running = getattr(_running, "call", None)
        call = running if isinstance(running, Call) else None  # not a ``StopLink``

        def on_loop() -> None:
            try:
                fn(*args)
            except Exception as exc:
                if call is None:
                    raise
                if call.error is None:
                    call.error = exc

        self._on_loop(on_loop, lazy=lazy)


# The call each pooled thread is running, if any (a ``StopLink`` on a thread it lent).
_running = threading.local()


def _run_sync_soon(
    token: anyio.lowlevel.EventLoopToken, fn: Callable[..., object], args: tuple[Any, ...]
) -> None:
    """Schedule ``fn(*args)`` on the loop of ``token`` from any thread, without waiting.
    anyio (>= 4.16) has this only on its backend class; one place uses it."""
    token.backend_class.run_sync_soon(fn, args, token.native_token)
