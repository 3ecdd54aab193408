"""Issue 24, item 2: cancelling a load ends it within a second whatever stage it is in,
including the work on its threads: the long loops there (parse, index, plan, layout and
allocation, reads, checks, populating mapped pages, the rehearsal of ``warm_up``) look at
a stop flag that a cancelled wait sets (``aiogguf.io.workers.raise_if_stopped``).

Each test holds a load in one stage by slowing one step of that stage's own loop (a
sleep per tensor, per job or per piece), waits until the stage is under way (an event),
cancels, and measures how long the load takes to end. Without the flag each stage would
run on for seconds; the default run bounds the wait at 5 s (a hang catcher), the timing
run at 1 s."""

from __future__ import annotations

import functools
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

import aiogguf
from aiogguf import _jobs as job_records
from aiogguf._core import layout
from aiogguf.io import _libc
from aiogguf.io.workers import raise_if_stopped
from aiogguf.stages import index, plan, validate
from aiogguf.stages.parse import _HeaderParser
from aiogguf.stages.read import Reader
from aiogguf.testing.synth import write_synthetic_model

STAGES = ["parse", "index", "plan", "layout", "read", "validate", "populate", "rehearsal"]
N_TENSORS = 20_000  # × 0.5 ms per tensor: 10 s of parse, index or plan unless stopped


def _many_tensors(path: Path, n_tensors: int) -> Path:
    """A llama file of ``n_tensors`` F32 tensors of 8 elements each, all in layer 0."""

    def gstr(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    kvs = (
        gstr("general.architecture") + struct.pack("<I", 8) + gstr("llama")  # string
        + gstr("llama.block_count") + struct.pack("<II", 4, 1)  # uint32 1
    )  # fmt: skip
    infos = b"".join(
        gstr(f"blk.0.t{i}.weight")  # name
        + struct.pack("<I", 1)  # n_dims
        + struct.pack("<Q", 8)  # ne[0]
        + struct.pack("<I", 0)  # type F32
        + struct.pack("<Q", 32 * i)  # offset: 32 bytes each, already aligned
        for i in range(n_tensors)
    )
    head = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, 2) + kvs + infos
    head += b"\0" * (-len(head) % 32)
    path.write_bytes(head + b"\0" * (32 * n_tensors))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("cancel-stages")
    synth = write_synthetic_model(folder / "s.gguf", size_bytes="16MiB", seed=9, n_layer=4)
    return {"many": _many_tensors(folder / "many.gguf", N_TENSORS), "synth": synth.path}


@dataclass
class Hold:
    """One step of a stage, slowed: ``entered`` once it has run, ``calls`` so far."""

    entered: threading.Event = field(default_factory=threading.Event)
    calls: int = 0

    def slowed(self, fn: Callable[..., Any], delay_s: float) -> Callable[..., Any]:
        @functools.wraps(fn)
        def step(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.entered.set()
            time.sleep(delay_s)
            return fn(*args, **kwargs)

        return step

    def until_stopped(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` after a long loop that looks at the stop flag (30 s unless stopped)."""

        @functools.wraps(fn)
        def step(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.entered.set()
            for _ in range(3000):
                raise_if_stopped()
                time.sleep(0.01)
            return fn(*args, **kwargs)

        return step


def _hold(stage: str, hold: Hold, monkeypatch: pytest.MonkeyPatch, files: dict[str, Path]):
    """Slow ``stage`` down; the file and the load's settings that reach it."""
    many = (files["many"], {"mode": "none", "check_tensors": False})
    jobs = {"chunk_size": "64KiB", "n_gpu_layers": 0}
    if stage == "parse":
        slow = hold.slowed(_HeaderParser.parse_tensor_info, 0.0005)
        monkeypatch.setattr(_HeaderParser, "parse_tensor_info", slow)
        return many
    if stage == "index":
        monkeypatch.setattr(index, "tensor_class", hold.slowed(index.tensor_class, 0.0005))
        return many
    if stage == "plan":
        monkeypatch.setattr(plan, "_choose", hold.slowed(plan._choose, 0.0005))
        return many
    if stage == "layout":  # cutting the read jobs: 256 of them
        monkeypatch.setattr(job_records, "ReadJob", hold.slowed(job_records.ReadJob, 0.02))
        return files["synth"], {"mode": "none", "check_tensors": False, **jobs}
    if stage == "read":
        monkeypatch.setattr(Reader, "read", hold.slowed(Reader.read, 0.05))
        return files["synth"], {"mode": "none", "check_tensors": False, **jobs}
    if stage == "validate":  # mapped tensors are checked from the file, piece by piece
        update = hold.slowed(validate.TensorChecker.update, 0.2)
        monkeypatch.setattr(validate.TensorChecker, "update", update)
        return files["synth"], {"mode": "mmap", "check_tensors": True, **jobs}
    if stage == "populate":
        madvise = _libc.madvise

        def slow_madvise(addr: int, size: int, advice: int) -> None:
            if advice == _libc.MADV_POPULATE_READ:
                hold.calls += 1
                hold.entered.set()
                time.sleep(0.05)
            madvise(addr, size, advice)

        monkeypatch.setattr(_libc, "madvise", slow_madvise)
        return files["synth"], {"mode": "mmap", "check_tensors": True, **jobs}
    assert stage == "rehearsal"
    monkeypatch.setattr(layout, "make_plan", hold.until_stopped(layout.make_plan))
    return None, {"mode": "none"}


async def _cancel_latency(stage: str, hold: Hold, path: Path | None, kw: dict[str, Any]) -> float:
    """Start the load (or ``warm_up``), cancel it once ``hold`` is entered; how long it
    took to end."""
    finished = False

    async def run() -> None:
        nonlocal finished
        if path is None:
            await aiogguf.warm_up(**kw)
        else:
            async with aiogguf.load(path, **kw):
                pass
        finished = True

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        entered = await anyio.to_thread.run_sync(hold.entered.wait, 60.0)
        assert entered, f"the load never reached its {stage} stage"
        calls = hold.calls
        cancelled_at = time.perf_counter()
        tg.cancel_scope.cancel()
    latency = time.perf_counter() - cancelled_at
    assert not finished, f"the {stage} stage ended before it was cancelled"
    # The stage stopped: it did not run on through its slowed steps.
    assert hold.calls - calls < 300, (stage, calls, hold.calls)
    return latency


def _measure(
    stage: str, monkeypatch: pytest.MonkeyPatch, files: dict[str, Path]
) -> Iterator[float]:
    hold = Hold()
    path, kw = _hold(stage, hold, monkeypatch, files)
    yield anyio.run(_cancel_latency, stage, hold, path, kw)


@pytest.mark.filterwarnings("ignore::aiogguf.errors.LoadWarning")
@pytest.mark.parametrize("stage", STAGES)
def test_cancel_during_a_stage_ends_the_load(
    stage: str, monkeypatch: pytest.MonkeyPatch, files: dict[str, Path]
) -> None:
    (latency,) = _measure(stage, monkeypatch, files)
    assert latency < 5.0, f"{stage}: the load ended {latency:.2f} s after its cancellation"


@pytest.mark.timing
@pytest.mark.filterwarnings("ignore::aiogguf.errors.LoadWarning")
@pytest.mark.parametrize("stage", STAGES)
def test_cancel_during_a_stage_ends_the_load_within_a_second(
    stage: str, monkeypatch: pytest.MonkeyPatch, files: dict[str, Path]
) -> None:
    (latency,) = _measure(stage, monkeypatch, files)
    print(f"cancel latency, {stage}: {latency * 1000:.0f} ms")
    assert latency < 1.0, f"{stage}: the load ended {latency:.2f} s after its cancellation"
