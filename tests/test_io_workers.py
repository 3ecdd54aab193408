"""A load's own threads: results and errors come back, a cancelled caller still
waits for the call it started, the threads run at a lower priority, go back to the
process's pool with the load's end and are lent again to the next one."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest

import aiogguf.io.workers
from aiogguf.io import workers as workers_module
from aiogguf.io.workers import (
    IDLE_NAME,
    LOAD_NICE,
    LoadThreads,
    StopLink,
    Stopped,
    idle_threads,
    raise_if_stopped,
)
from aiogguf.testing.synth import write_synthetic_model


def _names() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("aiogguf-reader")}


@pytest.mark.asyncio
async def test_results_errors_and_priority() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    async with LoadThreads(2) as threads:
        both = threading.Barrier(2, timeout=10)  # both threads run (they start soon)
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(threads.run_sync, both.wait)
        assert len(_names()) == 2
        assert await threads.run_sync(lambda a, b: a + b, 2, 3) == 5
        with pytest.raises(ZeroDivisionError):
            await threads.run_sync(lambda: 1 // 0)
        nice = await threads.run_sync(
            lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        )
        # Root may raise priority too; anyone may lower it: the readers sit below the loop.
        assert nice == base + LOAD_NICE or nice > base
    assert _names() == set()


@pytest.mark.asyncio
async def test_calls_run_at_once_on_every_thread() -> None:
    barrier = threading.Barrier(3, timeout=10)
    async with LoadThreads(3) as threads, anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(threads.run_sync, barrier.wait)


@pytest.mark.asyncio
async def test_a_cancelled_caller_waits_for_its_call() -> None:
    """The call writes into memory its caller owns: the caller must not leave before it."""
    finished: list[float] = []

    def slow() -> None:
        time.sleep(0.2)
        finished.append(time.perf_counter())

    async with LoadThreads(1) as threads:
        with anyio.move_on_after(0.02) as scope:
            await threads.run_sync(slow)
        left = time.perf_counter()
        assert scope.cancelled_caught
        assert finished
        assert finished[0] <= left
    assert _names() == set()


@pytest.mark.asyncio
async def test_a_thread_takes_its_next_call_without_the_loop() -> None:
    """Queued calls run back to back while the loop thread is busy: a thread hands its
    result to the loop without waiting for the loop to take it."""
    ran: list[str] = []
    both = threading.Event()

    def call(tag: str) -> None:
        ran.append(tag)
        if len(ran) == 2:
            both.set()

    async with LoadThreads(1) as threads, anyio.create_task_group() as tg:
        tg.start_soon(threads.run_sync, call, "a")
        tg.start_soon(threads.run_sync, call, "b")
        await anyio.wait_all_tasks_blocked()
        # Block the loop thread on purpose: only the worker can make progress now.
        assert both.wait(timeout=10), f"ran {ran} while the loop was busy"
    assert ran == ["a", "b"]


@pytest.mark.asyncio
async def test_a_thread_schedules_work_on_the_loop() -> None:
    """``call_soon`` (anyio's backend ``run_sync_soon``, the one call that needs anyio
    4.16 and below 5): from a load's thread, ``fn`` runs on the loop's thread."""
    loop_thread = threading.current_thread()
    ran_on: list[threading.Thread] = []
    done = anyio.Event()

    def on_loop(value: int) -> None:
        ran_on.append(threading.current_thread())
        assert value == 7
        done.set()

    async with LoadThreads(1) as threads:
        await threads.run_sync(threads.call_soon, on_loop, 7)
        with anyio.fail_after(5):
            await done.wait()
    assert ran_on == [loop_thread]


@pytest.mark.asyncio
async def test_threads_go_back_to_the_pool_and_are_reused() -> None:
    """A load's threads are lent by a process-wide pool: the next ``LoadThreads`` gets
    the same OS threads back, named for its work while it holds them, idle after."""

    def ident() -> int:
        return threading.get_ident()

    async with LoadThreads(2, name="aiogguf-first") as threads:
        first = {await threads.run_sync(ident) for _ in range(8)}
        held = {t.ident for t in threading.enumerate() if t.name.startswith("aiogguf-first")}
    assert first <= held
    assert idle_threads() >= 2
    idle = {t.ident for t in threading.enumerate() if t.name.startswith(IDLE_NAME)}
    assert held <= idle
    started_before = set(threading.enumerate())
    async with LoadThreads(2, name="aiogguf-second") as threads:
        second = {await threads.run_sync(ident) for _ in range(8)}
        assert set(threading.enumerate()) == started_before  # no thread started
    assert second <= held


@pytest.mark.asyncio
async def test_an_idle_thread_ends_after_the_idle_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workers_module, "IDLE_S", 0.05)
    async with LoadThreads(1, name="aiogguf-brief") as threads:
        thread = await threads.run_sync(threading.current_thread)
    thread.join(timeout=10)
    assert not thread.is_alive()


@pytest.mark.asyncio
async def test_many_lenders_at_once_each_get_their_own_threads() -> None:
    """Concurrent loads: each ``LoadThreads`` has its ``n`` threads to itself."""
    barrier = threading.Barrier(4, timeout=10)

    async def lend(tag: str) -> None:
        async with (
            LoadThreads(2, name=f"aiogguf-{tag}") as threads,
            anyio.create_task_group() as tg,
        ):
            for _ in range(2):
                tg.start_soon(threads.run_sync, barrier.wait)

    async with anyio.create_task_group() as tg:
        tg.start_soon(lend, "a")
        tg.start_soon(lend, "b")


def _run(script: str, *args: str) -> str:
    """``script`` in a fresh interpreter (a process's first threads; waits that are
    shielded from cancellation, bounded here by a timeout): its output."""
    out = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout


FIRST_LOAD = """
import sys, threading
import aiogguf

loop_starts = []
start = threading.Thread.start

def recorded(self):
    if threading.current_thread() is threading.main_thread():
        loop_starts.append(self.name)
    start(self)

threading.Thread.start = recorded
with aiogguf.load_sync(sys.argv[1], n_gpu_layers=0, mode="none") as model:
    pass
print(",".join(loop_starts))
"""


def test_no_load_waits_for_a_thread_to_start_on_the_loop(tmp_path: Path) -> None:
    """Starting a ``threading.Thread`` blocks until the thread runs (a millisecond on a
    busy machine): the loop's thread starts none, not even in a process's first load.
    The pool's starter (started without a wait) starts every load thread."""
    model = write_synthetic_model(tmp_path / "m.gguf", size_bytes="2MiB", seed=1, n_layer=2)
    assert _run(FIRST_LOAD, str(model.path)).strip() == ""


STARTER_REFUSED = """
import anyio
from aiogguf.io import workers

pool = workers._Pool()
workers._POOL = pool

def refuse():
    raise RuntimeError("can't start new thread")

async def main():
    async with workers.LoadThreads(1) as threads:  # the starter starts its thread
        await threads.run_sync(lambda: None)
    pool._start_starter = refuse
    pool._starter_started = False  # as in a process whose starter never started
    try:
        async with workers.LoadThreads(3):
            pass
    except RuntimeError as exc:
        print("raised:", exc)
    # The one thread that was lent before goes back to the pool; no other is left.
    print("idle:", pool.idle())

anyio.run(main)
"""


def test_a_starter_that_cannot_start_fails_the_lender() -> None:
    """If the starter cannot start (no threads left), the lender gets the error, and
    the idle thread it took goes back to the pool."""
    assert _run(STARTER_REFUSED).split("\n")[:2] == ["raised: can't start new thread", "idle: 1"]


THREAD_REFUSED = """
import threading
import anyio
from aiogguf.io import workers

workers._POOL = workers._Pool()

def refuse(self):
    raise RuntimeError("can't start new thread")

threading.Thread.start = refuse

async def main():
    async with workers.LoadThreads(2) as threads:
        for n in range(2):
            try:
                await threads.run_sync(lambda: n)
            except RuntimeError as exc:
                print("raised:", exc)
    workers.reserve_threads(3)
    async with workers.LoadThreads(1) as threads:
        try:
            await threads.run_sync(lambda: 0)
        except RuntimeError as exc:
            print("raised:", exc)
    print("idle:", workers.idle_threads())

anyio.run(main)
"""


def test_a_thread_that_cannot_start_fails_its_calls_instead_of_hanging() -> None:
    """A lender does not wait for its threads to start: if one cannot, every call of
    the lane fails with the reason, also for a lender that took a reserved thread
    (in a child process: see ``_run``)."""
    refused = "raised: can't start new thread"
    assert _run(THREAD_REFUSED).split("\n")[:4] == [refused] * 3 + ["idle: 0"]


@pytest.mark.asyncio
async def test_what_a_call_soon_callback_raises_fails_its_call() -> None:
    """A callback runs on the loop, which would only log what it raises: the
    ``run_sync`` of the call that scheduled it raises it instead."""

    def on_loop() -> None:
        raise RuntimeError("progress failed")

    def work(threads: LoadThreads) -> str:
        threads.call_soon(on_loop)
        return "done"

    async with LoadThreads(1) as threads:
        with pytest.raises(RuntimeError, match="progress failed"):
            await threads.run_sync(work, threads)
        # The lane goes on: the next call is not marked.
        assert await threads.run_sync(lambda: "next") == "next"


@pytest.mark.asyncio
async def test_a_lazy_report_waits_for_a_wake_up_and_runs_by_the_calls_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lazy ``call_soon`` (a progress report) asks for no wake-up of the loop soon
    after the last one: it waits for the next, which the call's end always brings, so it
    has run when ``run_sync`` returns."""
    monkeypatch.setattr(aiogguf.io.workers, "LAZY_S", 60.0)
    first_ran = threading.Event()
    lazy_ran = threading.Event()

    def work(threads: LoadThreads) -> bool:
        threads.call_soon(first_ran.set)  # wakes the loop
        assert first_ran.wait(timeout=10)
        threads.call_soon(lazy_ran.set, lazy=True)
        # The loop is idle and nothing woke it: the report waits.
        return lazy_ran.wait(timeout=0.2)

    async with LoadThreads(1) as threads:
        with anyio.fail_after(10):
            ran_before_the_end = await threads.run_sync(work, threads)
        assert not ran_before_the_end
        assert lazy_ran.is_set()


class _Interrupt(BaseException):
    """Stands for a KeyboardInterrupt raised on the loop's thread: the loop logs it and
    goes on, where a real one would end the loop."""


@pytest.mark.asyncio
async def test_what_an_interruption_leaves_on_the_loop_still_runs() -> None:
    """An interruption while the loop runs what the threads asked for (Ctrl-C on the
    loop's thread) does not lose the rest: what was queued behind it (a call's
    completion, say) still runs."""
    loop = asyncio.get_running_loop()
    seen: list[object] = []
    loop.set_exception_handler(lambda _loop, context: seen.append(context.get("exception")))
    after = anyio.Event()

    def interrupt() -> None:
        raise _Interrupt

    try:
        async with LoadThreads(1) as threads:
            # Both queued before the loop runs either: it runs them in one wake-up.
            threads._on_loop(interrupt)
            threads._on_loop(after.set)
            with anyio.fail_after(5):
                await after.wait()
    finally:
        loop.set_exception_handler(None)
    assert [type(e) for e in seen] == [_Interrupt]


@pytest.mark.asyncio
async def test_a_lender_leaves_without_waiting_for_its_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Leaving ``LoadThreads`` hands its threads back to the pool at once: a thread still
    on its way out of one lender's lane serves the next lender's calls after that."""
    leaving = threading.Event()
    order: list[str] = []
    serve = LoadThreads._serve

    def slow_to_leave(self: LoadThreads) -> None:
        serve(self)
        if self._name == "aiogguf-slow":
            leaving.wait(10)
            order.append("slow lane left")

    monkeypatch.setattr(LoadThreads, "_serve", slow_to_leave)
    async with LoadThreads(1, name="aiogguf-slow") as slow:
        ident = await slow.run_sync(threading.get_ident)
    assert order == []  # left, while its thread is still in the lane
    assert idle_threads() >= 1

    def ran() -> int:
        order.append("next call ran")
        return threading.get_ident()

    async with LoadThreads(1, name="aiogguf-next") as following:
        # The pool lends its most recently used thread: the one still leaving.
        leaving.set()
        assert await following.run_sync(ran) == ident
    assert order == ["slow lane left", "next call ran"]


WARMED = """
import sys, threading
import anyio
import aiogguf

async def main():
    settings = dict(mode="none", n_gpu_layers=0)
    await aiogguf.warm_up(**settings)
    before = set(threading.enumerate())
    async with aiogguf.load(sys.argv[1], **settings):
        pass
    print(len(set(threading.enumerate()) - before))

anyio.run(main)
"""


def test_after_warm_up_a_first_load_starts_no_thread(tmp_path: Path) -> None:
    """``warm_up`` waits until every thread a load takes runs: the pool starts threads
    without waiting for them, and the first load then finds them all ready."""
    model = write_synthetic_model(tmp_path / "m.gguf", size_bytes="2MiB", seed=2, n_layer=2)
    assert _run(WARMED, str(model.path)).strip() == "0"


@pytest.mark.asyncio
async def test_all_running_waits_for_every_thread() -> None:
    async with LoadThreads(3, name="aiogguf-all") as threads:
        await threads.all_running()
        running = [t for t in threading.enumerate() if t.name.startswith("aiogguf-all")]
        assert len(running) == 3
        assert all(t.is_alive() for t in running)


@pytest.mark.asyncio
async def test_a_thread_lent_by_a_call_stops_with_it() -> None:
    """A plain thread started by a call runs under its ``StopLink`` (here a link made on
    a linked thread, as a helper's helper): cancelling the call's caller stops it."""
    started, outcome = threading.Event(), []

    def spin() -> None:
        started.set()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            raise_if_stopped()
            time.sleep(0.005)
        outcome.append("never stopped")

    def call() -> None:
        link = StopLink()

        def helper() -> None:
            try:
                link.run(lambda: StopLink().run(spin))
            except Stopped:
                outcome.append("stopped")

        thread = threading.Thread(target=helper)
        thread.start()
        thread.join()

    async with LoadThreads(1) as threads, anyio.create_task_group() as tg:
        tg.start_soon(threads.run_sync, call)
        assert await anyio.to_thread.run_sync(started.wait, 10)
        tg.cancel_scope.cancel()
    assert outcome == ["stopped"]


def test_a_link_made_outside_a_call_stops_only_when_told() -> None:
    told = [False]
    link = StopLink(lambda: told[0])
    link.run(raise_if_stopped)  # no call to stop it
    told[0] = True
    assert link.stopped
    with pytest.raises(Stopped):
        link.run(raise_if_stopped)
    raise_if_stopped()  # the thread is unlinked again
