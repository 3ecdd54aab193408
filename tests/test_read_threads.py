"""Reader threads take their file's jobs one after another on their own: a loop that is
busy (or blocked) does not hold the reads back between jobs."""

from __future__ import annotations

import resource
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import aiogguf
from aiogguf.testing.synth import write_synthetic_model

PAGE = resource.getpagesize()


def _pages_faulted() -> int:
    # Each page a read lands in is fresh memory: one fault per page. (Counting bytes
    # read through /proc would count the polling's own reads too.)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.asyncio
async def test_a_blocked_loop_does_not_stop_the_reader_between_jobs(tmp_path: Path) -> None:
    model = write_synthetic_model(tmp_path / "m.gguf", size_bytes="32MiB", seed=3, n_layer=4)
    during: list[int] = []
    total_bytes = model.path.stat().st_size

    async def block_the_loop_once_reading() -> None:
        # Once the reader has landed a job or two: block the loop's thread, and see how
        # much the reader lands meanwhile.
        while not any(t.name.startswith("aiogguf-reader") for t in threading.enumerate()):
            await anyio.lowlevel.checkpoint()
        base = _pages_faulted()
        while (_pages_faulted() - base) * PAGE < 512 * 1024:
            await anyio.lowlevel.checkpoint()
        before = _pages_faulted()
        # Blocking the loop is the point: up to 5 s, not a fixed 0.5 s, so that a busy
        # machine's slow reader still shows it goes on (a round trip per job would stall
        # after 256 KiB however long the loop stays blocked).
        deadline = time.monotonic() + 5.0
        while (_pages_faulted() - before) * PAGE < total_bytes // 2:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)  # noqa: ASYNC251
        during.append((_pages_faulted() - before) * PAGE)

    async with anyio.create_task_group() as tg:
        tg.start_soon(block_the_loop_once_reading)
        async with aiogguf.load(
            model.path,
            mode="none",
            n_gpu_layers=0,
            check_tensors=False,
            readers=1,
            chunk_size="256KiB",
        ) as loaded:
            total = loaded.report.nbytes
            jobs = loaded.report.stage("read").items
    assert jobs >= 64, jobs
    # With a round trip through the loop per job, at most one more job (256 KiB) would
    # land while the loop is blocked; the reader reads on through the rest.
    assert during[0] >= total // 2, (during[0], total)


def test_an_error_in_the_loops_share_of_a_landed_job_fails_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the loop does with a job a reader landed runs as a loop callback, whose
    exceptions the loop would only log: the load fails with it instead."""
    model = write_synthetic_model(tmp_path / "m.gguf", size_bytes="4MiB", seed=4, n_layer=2)
    from aiogguf.stages.read import Reader

    calls = 0
    count = Reader.count

    def failing_count(self: Reader, *args: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("counting failed")
        count(self, *args)

    monkeypatch.setattr(Reader, "count", failing_count)
    with (
        pytest.raises(RuntimeError, match="counting failed"),
        aiogguf.load_sync(model.path, mode="none", n_gpu_layers=0, readers=1, chunk_size="256KiB"),
    ):
        pass


@pytest.mark.parametrize("mode", ["none", "mmap"])
def test_the_last_reader_checks_the_file_once_after_every_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """A file that only readers read is checked for changes by the reader that finishes
    last, after every job of the file (not by a call of its own through the loop)."""
    from aiogguf.io.files import DataFile
    from aiogguf.stages.read import Reader

    model = write_synthetic_model(tmp_path / "m.gguf", size_bytes="8MiB", seed=5, n_layer=4)
    lock = threading.Lock()
    reads = 0
    checks: list[tuple[str, int]] = []
    host_read = Reader.read
    check_unchanged = DataFile.check_unchanged

    def counted_read(self: Reader, *args: Any) -> None:
        nonlocal reads
        host_read(self, *args)
        with lock:
            reads += 1

    def recorded_check(self: DataFile) -> None:
        with lock:
            checks.append((threading.current_thread().name, reads))
        check_unchanged(self)

    monkeypatch.setattr(Reader, "read", counted_read)
    monkeypatch.setattr(DataFile, "check_unchanged", recorded_check)
    with aiogguf.load_sync(
        model.path, mode=mode, n_gpu_layers=0, check_tensors=False, readers=3, chunk_size="1MiB"
    ) as loaded:
        jobs = loaded.report.stage("read").items
    assert jobs >= 3, jobs
    assert len(checks) == 1, checks
    thread, done = checks[0]
    assert thread.startswith("aiogguf-reader"), thread
    assert done == jobs


def test_the_blocking_front_of_a_load_runs_off_the_loops_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Work that grows with the model (parsing, indexing, planning, laying out buffers,
    cutting jobs: 10^4 of them in a model of hundreds of GiB), the ``stat`` of each file
    and the start of the host reads run on the load's thread, never on the loop's."""
    import aiogguf._core.assemble as assemble
    import aiogguf._core.layout as layout

    model = write_synthetic_model(tmp_path / "m.gguf", size_bytes="4MiB", seed=6, n_layer=2)
    ran_on: dict[str, set[str]] = {}
    for name in (
        "read_whole_model",
        "make_plan",
        "layout_buffers",
        "tensor_slots",
        "allocate_host_images",
        "find_disks",
        "split_jobs",
        "HostReads",
    ):
        home = assemble if name == "read_whole_model" else layout
        original = getattr(home, name)

        def recorded(*args: Any, __name: str = name, __fn: Any = original, **kw: Any) -> Any:
            ran_on.setdefault(__name, set()).add(threading.current_thread().name)
            return __fn(*args, **kw)

        monkeypatch.setattr(home, name, recorded)
    with aiogguf.load_sync(model.path, mode="none", n_gpu_layers=0) as loaded:
        assert loaded.report.nbytes > 0
    assert len(ran_on) == 8, ran_on
    for name, threads in ran_on.items():
        assert threads == {"aiogguf-load-0"}, (name, threads)


@pytest.mark.parametrize("limits", [None, "each"])
def test_the_files_of_a_disk_share_its_readers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limits: str | None
) -> None:
    """A disk's reader limit holds for all its files together: three files on one disk
    with ``readers = 2`` are read by two threads at most, and each file is checked for
    changes once, after its last read; with a limit of one reader per file's directory
    (a disk each), each file is read by one thread at a time."""
    from aiogguf._config import Config
    from aiogguf.io.files import DataFile
    from aiogguf.stages.read import Reader

    dirs = [tmp_path / f"d{i}" for i in range(3)]
    for d in dirs:
        d.mkdir()
    model = write_synthetic_model(dirs[0] / "m.gguf", size_bytes="12MiB", split_count=3)
    for shard, d in zip(model.paths[1:], dirs[1:], strict=True):
        shard.rename(d / shard.name)
        shard.symlink_to(d / shard.name)
    settings: dict[str, Any] = {"chunk_size": "512KiB", "readers": 2}
    if limits == "each":
        settings["path"] = [{"prefix": str(d), "readers": 1} for d in dirs]
    config = Config.from_mapping({"load": {"mode": "none"}, "pipeline": settings})
    lock = threading.Lock()
    running: dict[int, int] = {}  # per file: reads now
    peak: dict[int, int] = {}
    total = [0, 0]  # reads now, most at once
    checked: list[str] = []
    read = Reader.read
    check_unchanged = DataFile.check_unchanged

    overlapped = threading.Event()  # two reads were running at once

    def counted(self: Reader, job: Any) -> None:
        with lock:
            running[job.file_index] = running.get(job.file_index, 0) + 1
            peak[job.file_index] = max(peak.get(job.file_index, 0), running[job.file_index])
            total[0] += 1
            total[1] = max(total)
            if total[0] >= 2:
                overlapped.set()
        # Until two reads have met, each waits for another (a loaded machine may run
        # one thread's reads back to back); a third reader, if any, would show then too.
        overlapped.wait(timeout=1.0)
        time.sleep(0.002)
        try:
            read(self, job)
        finally:
            with lock:
                running[job.file_index] -= 1
                total[0] -= 1

    def recorded(self: DataFile) -> None:
        with lock:
            checked.append(self.path)
        check_unchanged(self)

    monkeypatch.setattr(Reader, "read", counted)
    monkeypatch.setattr(DataFile, "check_unchanged", recorded)
    with aiogguf.load_sync(model.path, config, n_gpu_layers=0, check_tensors=False) as loaded:
        assert loaded.report.nbytes > 0
    assert sorted(peak) == [0, 1, 2]
    if limits is None:
        assert total[1] == 2, total  # both of the disk's readers, and no third
    else:
        assert max(peak.values()) == 1, peak  # one reader per disk
        assert total[1] >= 2, total  # the disks are read at the same time
    assert sorted(checked) == sorted(str(p) for p in model.paths)


def _check_threads_during_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, readers: int, cores: int
) -> tuple[dict[str, set[str]], bool]:
    """A buffered load with ``readers`` on a machine of ``cores``: the threads that read
    and checked, and whether a read started while the first check was held."""
    from aiogguf._core import layout
    from aiogguf.io.files import DataFile
    from aiogguf.stages.validate import Validation

    m = write_synthetic_model(tmp_path / "apart.gguf", size_bytes="4MiB", seed=5)
    threads: dict[str, set[str]] = {"read": set(), "check": set()}
    checking = threading.Event()
    read_during_check = threading.Event()
    read_into = DataFile.read_into
    check_piece = Validation.check_piece

    reads: list[int] = []

    def read(*args: Any, **kwargs: Any) -> Any:
        threads["read"].add(threading.current_thread().name)
        reads.append(1)
        if len(reads) > 1:
            # Not before a check began: a reader that raced through every job first
            # would leave no read to overlap it. Checks on the reader's own thread
            # cannot begin meanwhile: the wait times out, and no read overlaps them.
            checking.wait(2)
        if checking.is_set():
            read_during_check.set()
        return read_into(*args, **kwargs)

    def check(*args: Any, **kwargs: Any) -> Any:
        threads["check"].add(threading.current_thread().name)
        if not checking.is_set():
            checking.set()
            read_during_check.wait(2)
        return check_piece(*args, **kwargs)

    monkeypatch.setattr(layout, "usable_cores", lambda: cores)
    monkeypatch.setattr(DataFile, "read_into", read)
    monkeypatch.setattr(Validation, "check_piece", check)
    with aiogguf.load_sync(
        m.path, mode="none", chunk_size="256KiB", readers=readers, n_gpu_layers=0
    ) as model:
        assert model.report.validated == m.n_tensors
    return threads, read_during_check.is_set()


def test_fewer_readers_than_cores_check_apart_while_the_reader_reads_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a core the readers leave free, each landed job is checked on a check thread
    while the reader reads the next: the first check holds until a read has started."""
    threads, read_during_check = _check_threads_during_reads(tmp_path, monkeypatch, 1, 4)
    assert read_during_check, "no read started while a check was running"
    assert {name.rsplit("-", 1)[0] for name in threads["check"]} == {"aiogguf-check"}
    assert {name.rsplit("-", 1)[0] for name in threads["read"]} == {"aiogguf-reader"}


@pytest.mark.parametrize(("readers", "cores"), [(2, 2), (4, 64)])
def test_readers_on_every_core_or_outnumbering_the_checks_check_what_they_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, readers: int, cores: int
) -> None:
    """Readers that take every core, or more readers than check threads (a big host's
    default), check their own jobs: two check threads would not keep up with them."""
    threads, _ = _check_threads_during_reads(tmp_path, monkeypatch, readers, cores)
    assert {name.rsplit("-", 1)[0] for name in threads["check"]} == {"aiogguf-reader"}
