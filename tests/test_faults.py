"""Fault injection: whatever fails under a load, the load ends in one ``LoadError`` that
names the file, and leaves nothing behind (no descriptor, thread, mapping of the file,
simulated device buffer or staging slot). The process survives it.

- Files truncated at a random read call, in every mode, in subprocesses (a SIGBUS
  would kill the process, so the trials cannot run inside pytest's): ``fault_worker.py``.
- Files replaced, deleted or rewritten during a load.
- ``preadv`` failing with EIO, ending early, or returning short; ``O_DIRECT`` refused in
  the middle of a load; host memory (buffers, staging slots) refused with ENOMEM.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import examples
from fault_helpers import CallSeam, copy_file, holdings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from upload_helpers import buffers_in_use

import aiogguf
from aiogguf._core.engine import LoadWarning
from aiogguf.io import _libc
from aiogguf.io._devices.cpu import CpuDevice
from aiogguf.io._devices.pool import staging_pool
from aiogguf.io._devices.sim import SimDevice, SimUsage
from aiogguf.io.opener import RootedOpener
from aiogguf.testing.synth import SynthModel, write_synthetic_model

MODES = ("none", "direct", "mmap", "mlock")
WORKER = Path(__file__).with_name("fault_worker.py")
TRIALS_PER_MODE = examples(default=10, ci=20)
# Worker processes, each running its share of the modes (all of each mode's trials): one
# per core of a small machine, as starting one costs more than a mode's trials.
WORKER_MODES = ("none,mmap", "direct,mlock")
NO_SIM_USAGE = SimUsage(0, 0, 0, 0)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> SynthModel:
    path = tmp_path_factory.mktemp("faults") / "f.gguf"
    return write_synthetic_model(path, size_bytes="2MiB", seed=5, n_layer=4)


def _run_worker(modes: str, source: Path, workdir: Path, seeds: list[int]) -> tuple[int, str, str]:
    proc = subprocess.run(
        [sys.executable, str(WORKER), modes, str(source), str(workdir), *map(str, seeds)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.returncode, proc.stdout, proc.stderr


def test_truncated_at_random_points_in_every_mode(model: SynthModel, tmp_path: Path) -> None:
    """Finding 4: a file truncated during an mmap load killed the process (SIGBUS, exit
    135) from a check thread scanning the mapping. Now every mode, every cut, every
    moment ends in a LoadError naming the file and an offset, with nothing left behind."""
    assert sorted(",".join(WORKER_MODES).split(",")) == sorted(MODES)
    seeds = list(range(TRIALS_PER_MODE))
    with ThreadPoolExecutor(max_workers=len(WORKER_MODES)) as pool:
        runs = list(
            pool.map(
                lambda modes: (modes, *_run_worker(modes, model.path, tmp_path, seeds)),
                WORKER_MODES,
            )
        )
    trials: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for modes, rc, out, err in runs:
        assert rc == 0, f"modes {modes}: the worker died with status {rc}: {err[-2000:]}"
        for line in out.splitlines():
            result = json.loads(line)
            trials[result["mode"]].append(result)
    for mode, results in trials.items():
        assert len(results) == TRIALS_PER_MODE, mode
        for r in results:
            where = f"mode {mode}, seed {r['seed']} (cut {r['cut']} at call {r['at']})"
            assert r["fired"], where
            assert r["outcome"] == "LoadError", f"{where}: {r}"
            assert r["path"] == r["expected_path"], where
            assert isinstance(r["offset"], int), f"{where}: {r['message']}"
            # Other readers may have failed on the same cut: they ride along as notes,
            # and they are LoadErrors too.
            assert all(n.startswith("also: LoadError: ") for n in r["notes"]), where
            assert r["leaks"] == [], where


def test_truncated_while_a_mapped_tensor_is_checked(model: SynthModel, tmp_path: Path) -> None:
    """Finding 4, deterministically: the file is cut to nothing just as the first mapped
    tensor is handed to the checks. Scanning the mapping would raise SIGBUS."""
    path = tmp_path / "cut.gguf"
    copy_file(model.path, path)
    script = f"""
import os
import aiogguf
from aiogguf.stages.validate import ValidationCollector

original = ValidationCollector.submit

async def submit(self, *args, **kwargs):
    os.truncate({str(path)!r}, 0)
    await original(self, *args, **kwargs)

ValidationCollector.submit = submit
try:
    with aiogguf.load_sync({str(path)!r}, mode="mmap", check_tensors=True):
        print("loaded")
except aiogguf.LoadError as exc:
    print("LoadError", exc.path, exc.offset)
"""
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"status {proc.returncode}: {proc.stderr[-2000:]}"
    kind, named, offset = proc.stdout.split()
    assert (kind, named) == ("LoadError", str(path))
    assert int(offset) >= 0


# --- in-process faults ----------------------------------------------------------------


def _sim() -> SimDevice:
    return SimDevice("g0", free=64 * 1024**2)


def _load(path: Path, mode: str, sim: SimDevice | None, **overrides: Any) -> aiogguf.Model:
    """Load and close; returns the closed model (its report survives)."""
    devices = [CpuDevice(), sim] if sim is not None else None
    if sim is not None:
        overrides.update(n_gpu_layers=2, staging_buffer_size="128KiB")
    with (
        warnings.catch_warnings(),
        aiogguf.load_sync(
            path, mode=mode, chunk_size="64KiB", check_tensors=True, devices=devices, **overrides
        ) as m,
    ):
        warnings.simplefilter("ignore")
        return m


def _assert_nothing_beyond_the_pool(sim: SimDevice) -> None:
    """No device memory or stream is left, and the staging slots are back in the
    device's pool (which keeps them for the next load): freeing it frees them all."""
    assert buffers_in_use(sim) == sim.live.streams == 0
    assert staging_pool(sim).stats().leased_slots == 0
    aiogguf.release_staging_sync()
    assert sim.live == NO_SIM_USAGE


def _expect_clean_load_error(
    path: Path, mode: str, sim: SimDevice | None, inject: Callable[[], Any]
) -> aiogguf.LoadError:
    """Load under ``inject`` (a context manager factory); the load must fail with one
    LoadError naming ``path`` and leave nothing behind."""
    inodes = {path.stat().st_ino}
    before = holdings(inodes)
    with inject(), pytest.raises(aiogguf.LoadError) as caught:
        _load(path, mode, sim)
    assert caught.value.path == str(path)
    assert holdings(inodes).leaks(before) == []
    if sim is not None:
        _assert_nothing_beyond_the_pool(sim)
    return caught.value


class _FnSeam:
    """Replaces ``owner.name`` (a function) for a ``with`` block; ``fake(original, count,
    *args)`` decides what each call does (``count`` is 1-based)."""

    def __init__(self, owner: Any, name: str, fake: Callable[..., Any]) -> None:
        self.owner, self.name, self.fake = owner, name, fake
        self.count = 0

    def __enter__(self) -> _FnSeam:
        self.original = getattr(self.owner, self.name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return self.fake(self.original, self.count, *args, **kwargs)

        setattr(self.owner, self.name, call)
        return self

    def __exit__(self, *exc: object) -> None:
        setattr(self.owner, self.name, self.original)


def _count_calls(path: Path, mode: str, sim: SimDevice | None, owner: Any, name: str) -> int:
    with _FnSeam(owner, name, lambda original, _n, *a, **k: original(*a, **k)) as seam:
        _load(path, mode, sim)
    return seam.count


_COUNTS: dict[tuple[Any, ...], int] = {}


def _counted(key: tuple[Any, ...], count: Callable[[], int]) -> int:
    """``count()`` (how many calls of some kind a clean load makes), run once per ``key``
    (the test and its case): loads of the same file in the same setting make the same
    calls, so every example of a case picks from the first one's count. Drawing from the
    same range on every example also keeps hypothesis's replays (shrinking) the same."""
    if key not in _COUNTS:
        _COUNTS[key] = count()
    return _COUNTS[key]


def _pick(data: st.DataObject, first: int, last: int, label: str) -> int:
    """A call number in ``[first, last]``. Drawn as an integer of that range, so a case
    with few calls (one anonymous mapping, say) ends when each has failed once instead of
    failing the same call again."""
    return data.draw(st.integers(first, max(first, last)), label=label)


CASES = [(mode, gpu) for mode in MODES for gpu in (False, True)]
FAULT_SETTINGS = settings(
    max_examples=examples(default=4, ci=6),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    derandomize=True,
)


@pytest.mark.parametrize(("mode", "gpu"), CASES)
@FAULT_SETTINGS
@given(data=st.data())
def test_eio_from_preadv_ends_in_one_load_error(
    model: SynthModel, mode: str, gpu: bool, data: st.DataObject
) -> None:
    sim = _sim() if gpu else None
    total = _counted(
        ("preadv", mode, gpu),
        lambda: _count_calls(model.path, mode, _sim() if gpu else None, os, "preadv"),
    )
    assert total > 0
    at = _pick(data, 1, total, "failing call")

    def fake(original: Callable[..., int], n: int, *args: Any) -> int:
        if n == at:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return original(*args)

    error = _expect_clean_load_error(model.path, mode, sim, lambda: _FnSeam(os, "preadv", fake))
    assert "Input/output error" in str(error)


@pytest.mark.parametrize(("mode", "gpu"), CASES)
@FAULT_SETTINGS
@given(data=st.data())
def test_early_end_of_file_ends_in_one_load_error(
    model: SynthModel, mode: str, gpu: bool, data: st.DataObject
) -> None:
    """A read of tensor data that returns 0 bytes (the file ended) at a random call.
    (Direct mode's probe of the first block at open reads the header: it only asks
    whether O_DIRECT works, and its length does not matter.)"""
    sim = _sim() if gpu else None

    def count_data_reads() -> int:
        data_reads = 0

        def count(original: Callable[..., int], _n: int, fd: int, bufs: Any, off: int) -> int:
            nonlocal data_reads
            data_reads += off > 0
            return original(fd, bufs, off)

        with _FnSeam(os, "preadv", count):
            _load(model.path, mode, _sim() if gpu else None)
        return data_reads

    at = _pick(
        data, 1, _counted(("data reads", mode, gpu), count_data_reads), "call that finds the end"
    )
    seen = 0

    def fake(original: Callable[..., int], _n: int, fd: int, bufs: Any, off: int) -> int:
        nonlocal seen
        seen += off > 0
        return 0 if off > 0 and seen == at else original(fd, bufs, off)

    error = _expect_clean_load_error(model.path, mode, sim, lambda: _FnSeam(os, "preadv", fake))
    assert error.offset is not None


@pytest.fixture(scope="module")
def expected(model: SynthModel) -> dict[str, bytes]:
    """Tensor name → its bytes in the file (read once, never modified)."""
    data = model.path.read_bytes()
    with aiogguf.load_sync(model.path, mode="none", n_gpu_layers=0) as m:
        return {e.name: data[e.offset : e.end] for e in (m.index[t.name] for t in m.index.tensors)}


@pytest.mark.parametrize("mode", ["none", "direct"])
@FAULT_SETTINGS
@given(seed=st.integers(0, 2**32 - 1))
def test_short_reads_are_continued(
    model: SynthModel, expected: dict[str, bytes], mode: str, seed: int
) -> None:
    """``preadv`` may return fewer bytes than asked anywhere: the load goes on and lands
    the same bytes."""
    import random

    rng = random.Random(seed)

    def fake(original: Callable[..., int], _n: int, fd: int, buffers: list[Any], off: int) -> int:
        view = memoryview(buffers[0]).cast("B")
        if len(view) > 1 and rng.random() < 0.5:
            view = view[: rng.randrange(1, len(view))]
        return original(fd, [view], off)

    with _FnSeam(os, "preadv", fake), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with aiogguf.load_sync(model.path, mode=mode, chunk_size="64KiB") as m:
            for name, raw in expected.items():
                assert bytes(m.raw(name)) == raw, name


@pytest.mark.parametrize("gpu", [False, True])
@FAULT_SETTINGS
@given(data=st.data())
def test_o_direct_refused_mid_load_falls_back(
    model: SynthModel, expected: dict[str, bytes], gpu: bool, data: st.DataObject
) -> None:
    """A direct read refused (EINVAL) in the middle of a load: the file goes on buffered,
    with a warning, and every byte lands; nothing is left behind."""
    sim = _sim() if gpu else None

    def count_direct_reads() -> int:
        direct_calls = 0

        def count(original: Callable[..., int], _n: int, fd: int, *args: Any) -> int:
            nonlocal direct_calls
            direct_calls += _is_direct(fd)
            return original(fd, *args)

        with _FnSeam(os, "preadv", count):
            _load(model.path, "direct", _sim() if gpu else None)
        return direct_calls

    direct_calls = _counted(("direct reads", gpu), count_direct_reads)
    if not direct_calls:
        pytest.skip("this filesystem refuses O_DIRECT")
    at = _pick(data, 2, direct_calls, "refused direct read")
    seen = 0

    def refuse(original: Callable[..., int], _n: int, fd: int, *args: Any) -> int:
        nonlocal seen
        if _is_direct(fd):
            seen += 1
            if seen >= at:
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return original(fd, *args)

    inodes = {model.path.stat().st_ino}
    before = holdings(inodes)
    devices = [CpuDevice(), sim] if sim is not None else None
    overrides: dict[str, Any] = {"n_gpu_layers": 2, "staging_buffer_size": "128KiB"} if gpu else {}
    with _FnSeam(os, "preadv", refuse), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with aiogguf.load_sync(
            model.path, mode="direct", chunk_size="64KiB", devices=devices, **overrides
        ) as m:
            for name, raw in expected.items():
                if _on_host(m, name):
                    assert bytes(m.raw(name)) == raw, name
    said = [str(w.message) for w in caught if issubclass(w.category, LoadWarning)]
    assert any("O_DIRECT read was refused" in text for text in said), said
    assert holdings(inodes).leaks(before) == []
    if sim is not None:
        _assert_nothing_beyond_the_pool(sim)


def _is_direct(fd: int) -> bool:
    import fcntl

    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def _on_host(m: aiogguf.Model, name: str) -> bool:
    return next(t for t in m.plan.tensors if t.name == name).device == "CPU"


@pytest.mark.parametrize(("mode", "gpu"), [c for c in CASES if c[1] or c[0] in ("none", "direct")])
@FAULT_SETTINGS
@given(data=st.data())
def test_host_memory_refused_ends_in_one_load_error(
    model: SynthModel, mode: str, gpu: bool, data: st.DataObject
) -> None:
    """ENOMEM from an anonymous mapping (a host buffer, a staging slot) at a random
    allocation: a LoadError (exit status 2, as for a refused file mapping), not a
    MemoryError."""
    sim = _sim() if gpu else None

    def count_allocations() -> int:
        seen = 0

        def count(original: Callable[..., mmap.mmap], _n: int, fd: int, *args: Any, **kw: Any):
            nonlocal seen
            seen += fd == -1
            return original(fd, *args, **kw)

        aiogguf.release_staging_sync()
        with _FnSeam(mmap, "mmap", count):
            _load(model.path, mode, _sim() if gpu else None)
        return seen

    seen = _counted(("allocations", mode, gpu), count_allocations)
    aiogguf.release_staging_sync()  # the faulty load pins its staging slots anew
    assert seen > 0
    at = _pick(data, 1, seen, "refused allocation")
    anon = 0

    def refuse(original: Callable[..., mmap.mmap], _n: int, fd: int, *args: Any, **kw: Any):
        nonlocal anon
        if fd == -1:
            anon += 1
            if anon == at:
                raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        return original(fd, *args, **kw)

    error = _expect_clean_load_error(model.path, mode, sim, lambda: _FnSeam(mmap, "mmap", refuse))
    assert "memory" in str(error)


@pytest.mark.parametrize("mode", ["mmap", "mlock"])
@FAULT_SETTINGS
@given(data=st.data())
def test_populate_failing_ends_in_one_load_error(
    model: SynthModel, mode: str, data: st.DataObject
) -> None:
    """EIO from making mapped pages resident (``MADV_POPULATE_READ``) at a random call;
    in mode ``mlock`` the ranges lock their pages as the populate faults them in."""

    def count_populates() -> int:
        populates = 0

        def count(original: Callable[..., None], _n: int, addr: int, size: int, advice: int):
            nonlocal populates
            populates += advice == _libc.MADV_POPULATE_READ
            original(addr, size, advice)

        with _FnSeam(_libc, "madvise", count):
            _load(model.path, mode, None)
        return populates

    at = _pick(data, 1, _counted(("populates", mode), count_populates), "failing populate")
    seen = 0

    def fail(original: Callable[..., None], _n: int, addr: int, size: int, advice: int) -> None:
        nonlocal seen
        if advice == _libc.MADV_POPULATE_READ:
            seen += 1
            if seen == at:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        original(addr, size, advice)

    error = _expect_clean_load_error(
        model.path, mode, None, lambda: _FnSeam(_libc, "madvise", fail)
    )
    assert "Input/output error" in str(error)


@FAULT_SETTINGS
@given(data=st.data())
def test_lock_failing_ends_in_one_load_error(model: SynthModel, data: st.DataObject) -> None:
    """Where the kernel cannot lock on fault (no ``mlock2``), mode ``mlock`` reads pages
    in by locking them, job by job. A page that cannot be read makes ``mlock`` fail with
    ENOMEM (the kernel's word for a fault while locking, as for the lock limit): the load
    then makes the range resident without the lock, meets the I/O error itself, and
    fails with it."""

    def no_mlock2(_original: Callable[..., None], _n: int, *args: Any) -> None:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    def count_locks() -> int:
        locks = 0

        def count(original: Callable[..., None], _n: int, addr: int, size: int) -> None:
            nonlocal locks
            locks += 1
            original(addr, size)

        with _FnSeam(_libc, "mlock", count), _FnSeam(_libc, "mlock2", no_mlock2):
            _load(model.path, "mlock", None)
        return locks

    at = _pick(data, 1, _counted(("locks",), count_locks), "failing lock")
    failed: list[tuple[int, int]] = []

    def lock(original: Callable[..., None], n: int, addr: int, size: int) -> None:
        if n == at:
            failed.append((addr, addr + size))
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        original(addr, size)

    def populate(original: Callable[..., None], _n: int, addr: int, size: int, advice: int) -> None:
        if advice == _libc.MADV_POPULATE_READ and any(lo <= addr < hi for lo, hi in failed):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        original(addr, size, advice)

    def seams() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(_FnSeam(_libc, "mlock2", no_mlock2))
        stack.enter_context(_FnSeam(_libc, "mlock", lock))
        stack.enter_context(_FnSeam(_libc, "madvise", populate))
        return stack

    error = _expect_clean_load_error(model.path, "mlock", None, seams)
    assert "Input/output error" in str(error)


# --- files replaced, deleted, rewritten ------------------------------------------------


def _change_during_load(
    tmp_path: Path, model: SynthModel, mode: str, change: Callable[[Path], None]
) -> aiogguf.LoadError:
    path = tmp_path / f"changing-{mode}.gguf"
    copy_file(model.path, path)
    inodes = {path.stat().st_ino}
    before = holdings(inodes)
    seam = CallSeam(lambda: change(path), 2)
    with seam.installed(), pytest.raises(aiogguf.LoadError) as caught:
        _load(path, mode, None)
    assert seam.fired
    assert caught.value.path == str(path)
    assert holdings(inodes).leaks(before) == []
    return caught.value


@pytest.mark.parametrize("mode", MODES)
def test_file_replaced_during_load(tmp_path: Path, model: SynthModel, mode: str) -> None:
    def replace(path: Path) -> None:
        other = path.with_suffix(".new")
        copy_file(model.path, other)
        os.replace(other, path)

    error = _change_during_load(tmp_path, model, mode, replace)
    assert "replaced" in str(error)


@pytest.mark.parametrize("mode", MODES)
def test_file_deleted_during_load(tmp_path: Path, model: SynthModel, mode: str) -> None:
    error = _change_during_load(tmp_path, model, mode, lambda p: p.unlink())
    assert "deleted" in str(error)


@pytest.mark.parametrize("mode", MODES)
def test_file_rewritten_during_load(tmp_path: Path, model: SynthModel, mode: str) -> None:
    def rewrite(path: Path) -> None:
        with open(path, "r+b") as f:
            f.seek(-16, os.SEEK_END)
            f.write(b"\0" * 16)
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))

    error = _change_during_load(tmp_path, model, mode, rewrite)
    assert "modified" in str(error)


@pytest.mark.parametrize("mode", MODES)
def test_finding_8_rewrite_in_place_with_its_time_set_back_is_detected(
    tmp_path: Path, model: SynthModel, mode: str
) -> None:
    """An in-place overwrite that restores the modification time (``os.utime``) passed
    the end-of-load check (size and mtime only); the status-change time gives it away."""

    def rewrite(path: Path) -> None:
        was = path.stat()
        # File times tick with the kernel's clock (milliseconds): a change in the same
        # tick as the copy that made the file would leave even ctime as it was.
        time.sleep(0.03)
        with open(path, "r+b") as f:
            f.seek(-16, os.SEEK_END)
            f.write(b"\x01" * 16)
        os.utime(path, ns=(was.st_atime_ns, was.st_mtime_ns))
        assert path.stat().st_mtime_ns == was.st_mtime_ns

    error = _change_during_load(tmp_path, model, mode, rewrite)
    assert "modified" in str(error)


async def _load_rooted(path: Path, root: Path, mode: str) -> bytes:
    """Load ``path`` held to ``root``; the bytes of its first tensor, as loaded."""
    with RootedOpener([root]) as opener:
        async with aiogguf.load(
            path, opener=opener, mode=mode, chunk_size="64KiB", check_tensors=True
        ) as m:
            return bytes(m.raw(m.index.tensors[0].name))


async def _first_tensor_bytes(path: Path) -> bytes:
    async with aiogguf.load(path, mode="none") as m:
        return bytes(m.raw(m.index.tensors[0].name))


@pytest.mark.parametrize("outside", ["absent", "present"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.asyncio
async def test_finding_8_a_symlink_then_dot_dot_loads_the_file_opened(
    tmp_path: Path, model: SynthModel, mode: str, outside: str
) -> None:
    """``root/sub/etc/../../m.gguf`` with ``sub/etc`` → elsewhere opens ``root/m.gguf``
    (the path is matched to its root by its text); the end-of-load check looked the
    name up again, landed outside the root and failed the load, saying whether that
    outside file existed."""
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    copy_file(model.path, root / "m.gguf")
    far = tmp_path / "outside" / "a" / "b"
    far.mkdir(parents=True)
    (root / "sub" / "etc").symlink_to(far)
    if outside == "present":
        copy_file(model.path, tmp_path / "outside" / "m.gguf")
    path = root / "sub" / "etc" / ".." / ".." / "m.gguf"
    assert await _load_rooted(path, root, mode) == await _first_tensor_bytes(root / "m.gguf")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.asyncio
async def test_finding_8_a_root_symlink_repointed_during_the_load_does_not_fail_it(
    tmp_path: Path, model: SynthModel, mode: str
) -> None:
    """The root is a symlink an operator repoints to a new directory while a load runs:
    the load reads the file it opened and ends well (it failed with "replaced")."""
    old, new = tmp_path / "v1", tmp_path / "v2"
    old.mkdir()
    new.mkdir()
    copy_file(model.path, old / "m.gguf")
    copy_file(model.path, new / "m.gguf")
    root = tmp_path / "models"
    root.symlink_to(old)

    def repoint() -> None:
        link = tmp_path / "models.new"
        link.symlink_to(new)
        os.replace(link, root)

    seam = CallSeam(repoint, 2)
    with seam.installed():
        loaded = await _load_rooted(root / "m.gguf", root, mode)
    assert seam.fired
    assert loaded == await _first_tensor_bytes(old / "m.gguf")


@pytest.mark.parametrize("mode", ["mmap", "mlock"])
def test_a_file_changed_after_its_readers_left_it_fails_a_mapped_load(
    model: SynthModel, tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checks of mapped tensors read the file on the check threads, which may be after
    the readers have left it and checked it unchanged. A file grown then (every read of
    it still succeeds) fails the load all the same."""
    import threading

    from aiogguf.io.files import DataFile

    path = tmp_path / "grown.gguf"
    copy_file(model.path, path)
    verified = threading.Event()
    grown: list[int] = []
    check_unchanged, read_into = DataFile.check_unchanged, DataFile.read_into

    def checked(self: DataFile) -> None:
        check_unchanged(self)
        verified.set()

    def read(self: DataFile, dest: Any, offset: int) -> None:
        if threading.current_thread().name != "aiogguf-load" and not grown:
            assert verified.wait(10), "the readers never checked the file"
            grown.append(offset)
            os.truncate(path, path.stat().st_size + 4096)
        read_into(self, dest, offset)

    monkeypatch.setattr(DataFile, "check_unchanged", checked)
    monkeypatch.setattr(DataFile, "read_into", read)

    def load() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a refused mlock: not the point here
            with aiogguf.load_sync(path, mode=mode, check_tensors=True, n_gpu_layers=0):
                pass

    with pytest.raises(aiogguf.LoadError) as info:
        load()
    assert grown
    assert "modified" in str(info.value) or "changed" in str(info.value)
