"""Ctrl-C while a command's event loop runs: ``interrupt_main_thread`` (what the CLI's
SIGINT handler calls) cancels the run, every task it started runs its cleanup, and the
run raises ``KeyboardInterrupt``. Raised where the handler ran, the interrupt could land
between a task's creating a coroutine and scheduling it: the interpreter then warned, as
it ended, of a coroutine never awaited."""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import warnings
from pathlib import Path

import anyio
import pytest

from aiogguf._api import load
from aiogguf._config import Config
from aiogguf._events import Progress
from aiogguf._run import interrupt_run, run
from aiogguf.cli import interrupt_main_thread
from aiogguf.testing.synth import write_synthetic_model


@pytest.fixture(params=["asyncio", "uvloop"])
def loop_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "asyncio":
        monkeypatch.setitem(sys.modules, "uvloop", None)  # ``import uvloop`` fails
    else:
        pytest.importorskip("uvloop")
    return str(request.param)


def never_awaited() -> list[str]:
    """Warnings of coroutines never awaited, once the garbage they were is collected."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    return [str(w.message) for w in caught if "never awaited" in str(w.message)]


def test_an_interrupt_between_creating_tasks_cancels_them_all_after_they_start(
    loop_kind: str,
) -> None:
    log: list[str] = []

    async def child(i: int) -> None:
        log.append(f"start {i}")
        try:
            await anyio.sleep(30)
        finally:
            log.append(f"cleanup {i}")

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(child, 0)
            interrupt_main_thread()  # the signal, between two ``start_soon``
            tg.start_soon(child, 1)
            await anyio.sleep(30)

    gc.collect()
    with pytest.raises(KeyboardInterrupt):
        run(main)
    assert sorted(log) == ["cleanup 0", "cleanup 1", "start 0", "start 1"]
    assert never_awaited() == []


def test_outside_a_run_the_interrupt_is_raised_where_it_lands() -> None:
    assert interrupt_run() is False
    with pytest.raises(KeyboardInterrupt):
        interrupt_main_thread()


def test_work_that_swallows_its_cancellation_still_ends_interrupted() -> None:
    async def stubborn() -> str:
        interrupt_main_thread()
        # A bug in the work, which must not turn Ctrl-C into success:
        with contextlib.suppress(BaseException):
            await anyio.sleep(30)
        return "went on"

    with pytest.raises(KeyboardInterrupt):
        run(stubborn)
    assert interrupt_run() is False  # nothing left to interrupt


@pytest.mark.parametrize("at_event", [0, 1, 2])  # parse, plan, done
def test_a_load_interrupted_at_any_progress_event_unwinds_completely(
    at_event: int, tmp_path: Path, loop_kind: str
) -> None:
    """A real load, interrupted at its N-th progress event (on the loop's thread): the run
    raises ``KeyboardInterrupt``, no thread does the load's work any more (its pooled
    threads are parked, named ``idle …``), no coroutine is dropped."""
    path = write_synthetic_model(tmp_path / "m.gguf", size_bytes="2MiB", seed=5, n_layer=4).path
    events: list[Progress] = []

    def on_progress(event: Progress) -> None:
        events.append(event)
        if len(events) == at_event + 1:
            interrupt_main_thread()

    async def go() -> None:
        async with load(path, Config(), progress=on_progress):
            await anyio.sleep(3)  # a load that ends before the signal: held until it

    gc.collect()
    with pytest.raises(KeyboardInterrupt):
        run(go)
    assert [t.name for t in threading.enumerate() if t.name.startswith("aiogguf-")] == []
    assert never_awaited() == []
