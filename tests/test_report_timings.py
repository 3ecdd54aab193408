"""The report's stage timings tell what each stage did, checked by the order of events
and by work injected into the checks, never by how fast this machine is.

Each stage's ``start_s``/``end_s`` are its own first start and last end (seconds since
the load began) and ``busy_s`` its own working time: a slow check shows up in the
validate stage's busy time, not in the read's, and the metadata stages end before a
byte is read."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from aiogguf._checks import PieceCheck, TensorChecker
from aiogguf._report import LoadReport
from aiogguf.io._devices.cpu import CpuDevice
from aiogguf.io._devices.sim import SimDevice
from aiogguf.testing.synth import SynthModel, write_synthetic_model

api = pytest.importorskip("aiogguf._api")

GiB = 1024**3
SLEEP_S = 0.002  # injected into every check call


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> SynthModel:
    path = tmp_path_factory.mktemp("timings") / "m.gguf"
    return write_synthetic_model(path, size_bytes="2MiB", seed=11, n_layer=4)


class _SlowCalls:
    """Wraps a check method: each call sleeps first, and calls are counted."""

    def __init__(self, original: Callable[..., Any]) -> None:
        self.calls = 0
        lock = threading.Lock()

        def slow(*args: Any, **kwargs: Any) -> Any:
            with lock:
                self.calls += 1
            time.sleep(SLEEP_S)
            return original(*args, **kwargs)

        self.method = slow


def _check_order(report: LoadReport) -> None:
    """What holds for every load: stage spans in pipeline order, inside the load."""
    names = [s.name for s in report.stages]
    assert names == ["parse+index", "plan", "allocate", "read", "validate"]
    parse, plan, allocate, read, validate = report.stages
    for s in report.stages:
        assert 0 <= s.start_s <= s.end_s <= report.total_s, s
        assert s.wall_s == pytest.approx(s.end_s - s.start_s)
        assert s.wall_s <= report.total_s, s
        assert s.busy_s >= 0, s
    # The metadata stages end before the streaming half begins.
    assert parse.end_s <= plan.start_s
    assert plan.end_s <= allocate.start_s
    assert parse.end_s <= read.start_s
    # A tensor is read into a buffer that exists, and checked once it has landed.
    assert allocate.start_s <= read.start_s
    assert read.start_s <= validate.start_s
    # One thread allocates: its busy time cannot exceed its wall time.
    assert allocate.busy_s <= allocate.wall_s + 1e-9
    # Counts.
    assert parse.items == 1
    assert plan.items >= report.n_tensors
    assert allocate.items == len(report.buffers)
    assert allocate.nbytes >= sum(b.nbytes for b in report.buffers if not b.lazy)
    assert read.nbytes == report.nbytes == sum(f.nbytes for f in report.files)
    assert read.items == sum(f.reads for f in report.files) > 0
    assert validate.items == report.validated == report.n_tensors


@pytest.mark.asyncio
async def test_piece_checks_on_a_sim_gpu_count_in_validate(
    model: SynthModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mode none with half the layers on a simulated GPU: host tensors are checked
    piece by piece on the reader threads, device tensors in the transfer threads'
    staging slots. Every piece check sleeps; the validate stage's busy time holds every
    sleep, the upload entry counts the copies."""
    slow = _SlowCalls(PieceCheck.check_piece)
    monkeypatch.setattr(PieceCheck, "check_piece", slow.method)
    sim = SimDevice("g0", free=GiB, bandwidth=2_000_000_000, seed=1)
    async with api.load(
        model.path,
        devices=[CpuDevice(), sim],
        n_gpu_layers=3,
        mode="none",
        staging_buffers=2,
        staging_buffer_size="64KiB",
        chunk_size="64KiB",
    ) as loaded:
        report = loaded.report
    # Both ways of checking pieces ran: host memory (g0's pinned host type) and g0.
    assert {b.buffer_type for b in report.buffers} == {"g0", "g0_Host"}
    _check_order(report)
    validate = report.stage("validate")
    assert slow.calls > 0
    assert validate.busy_s >= slow.calls * SLEEP_S
    # The pieces checked are the bytes loaded, each once.
    assert validate.nbytes == report.nbytes
    (upload,) = report.uploads
    assert upload.device == "g0"
    assert upload.copies > 0
    assert upload.bytes_copied > 0


@pytest.mark.asyncio
async def test_whole_tensor_checks_of_a_mapped_load_count_in_validate(
    model: SynthModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mode mmap: tensors are checked whole, on the check threads. Every checker call
    sleeps; the validate stage's busy time holds every sleep, the read's holds none of
    them (the checks run beside the reads, not in them)."""
    slow = _SlowCalls(TensorChecker.update)
    monkeypatch.setattr(TensorChecker, "update", slow.method)
    async with api.load(model.path, mode="mmap", n_gpu_layers=0) as loaded:
        report = loaded.report
    _check_order(report)
    validate = report.stage("validate")
    assert slow.calls >= report.n_tensors
    assert validate.busy_s >= slow.calls * SLEEP_S
    assert validate.nbytes == report.nbytes
    assert report.uploads == ()


def test_build_report_takes_records_in_and_gives_the_report_out(model: SynthModel) -> None:
    """No stage needed: the stage times, file counters and upload counters become the
    report's entries as given."""
    from aiogguf._jobs import StageTimes
    from aiogguf._records import Plan
    from aiogguf._report import build_report
    from aiogguf.stages.read import FileStats
    from aiogguf.stages.upload import DeviceUploadStats

    with aiogguf_load(model) as loaded:
        plan: Plan = loaded.plan
    times = StageTimes(start_s=0.5, end_s=2.0, busy_s=3.0, items=4, nbytes=5)
    stats = FileStats(nbytes=7, reads=2, busy_s=0.1, first_start=0.6, last_end=1.9)
    upload = DeviceUploadStats(
        "g0", True, 2, 64, 128, 7, 1, 0, 0.0, 0.25, device_bytes_allocated=4096
    )
    report = build_report(
        plan,
        path=model.path.as_posix(),
        total_s=2.5,
        stages=[("read", times)],
        files=[("a.gguf", stats, True, "dev 1:2")],
        uploads=[upload],
        validated=3,
        warnings=["w"],
    )
    (read,) = report.stages
    assert (read.name, read.start_s, read.end_s, read.busy_s) == ("read", 0.5, 2.0, 3.0)
    assert read.wall_s == pytest.approx(1.5)
    assert (read.items, read.nbytes) == (4, 5)
    (f,) = report.files
    assert (f.path, f.nbytes, f.reads, f.start_s, f.end_s, f.direct, f.disk) == (
        "a.gguf",
        7,
        2,
        0.6,
        1.9,
        True,
        "dev 1:2",
    )
    (u,) = report.uploads
    assert (u.device, u.slots, u.bytes_copied, u.fill_s) == ("g0", 2, 7, 0.25)
    assert (u.pinned_bytes_allocated, u.device_bytes_allocated) == (128, 4096)
    loaded_tensors = [t for t in plan.tensors if not t.lazy]
    assert report.nbytes == sum(t.nbytes for t in loaded_tensors)
    assert report.n_tensors == len(loaded_tensors)
    assert (report.mode, report.validated, report.warnings) == (plan.mode, 3, ("w",))
    assert len(report.buffers) == len(plan.buffers)


def aiogguf_load(model: SynthModel) -> Any:
    import aiogguf

    return aiogguf.load_sync(model.path, mode="none", n_gpu_layers=0)
