"""Writes through the views of a mapped model (modes ``mmap``, ``mlock``) never end the
process: each raises (numpy arrays, ``raw``: read-only) or lands in the process's own
copy of the page (torch tensors, however they are made), and the file, the page cache
and every other load keep the file's bytes.

Before, the mappings were shared and read-only, and every torch write was SIGSEGV.
Each write runs in a process of its own (``mapped_write_worker.py``), so that a crash
shows as the signal in its exit status. Oracles: the file's sha256, its bytes read with
``pread``, a second load, and ``/proc/self/smaps`` (pages of the process's own).
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mapped_write_worker import TORCH_WAYS, WAYS

import aiogguf
import aiogguf.io.mapping as mapping_module
from aiogguf._images import MappedImage
from aiogguf.errors import LoadError
from aiogguf.io import _libc
from aiogguf.io.buffers import PAGE_BYTES
from aiogguf.io.files import align_down, align_up
from aiogguf.io.mapping import may_lock_past_limit, memlock_limit, open_mapping
from aiogguf.testing.synth import SynthModel, SynthTensor, write_synthetic_model

WORKER = Path(__file__).with_name("mapped_write_worker.py")
MODES = ("mmap", "mlock")
# Ways whose write must raise, and what: the arrays and bytes stay read-only.
RAISES = {
    "numpy": "ValueError: assignment destination is read-only",
    "raw": "TypeError: cannot modify read-only memory",
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> SynthModel:
    path = tmp_path_factory.mktemp("mapped_writes") / "m.gguf"
    return write_synthetic_model(path, size_bytes="2MiB", seed=11, n_layer=2)


def target(model: SynthModel) -> SynthTensor:
    """The largest F32 tensor: several pages, written whole by most ways."""
    return max(model.tensors_of_type("F32"), key=lambda t: t.nbytes)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def can_lock(nbytes: int) -> bool:
    limit = memlock_limit()
    return may_lock_past_limit() or limit is None or limit >= nbytes


def run_worker(model: SynthModel, mode: str, way: str) -> subprocess.CompletedProcess[str]:
    t = target(model)
    args = [str(model.path), mode, way, t.name, str(t.file_offset), str(t.nbytes)]
    return subprocess.run(
        [sys.executable, str(WORKER), *args], capture_output=True, text=True, timeout=90
    )


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("mode", MODES)
def test_a_write_through_any_view_raises_or_stays_private(
    model: SynthModel, mode: str, way: str
) -> None:
    """Issue 35, item 8: 9 ways of writing, each in both mapped modes. The process lives;
    the numpy and ``raw`` writes raise; every torch write shows in the model that made
    it, costs pages of the process's own (no more than the tensor's), and nothing else:
    a second load in the same process and one in this process see the file's bytes, and
    the file's sha256 is unchanged."""
    if way in TORCH_WAYS:
        pytest.importorskip("torch")
    file_bytes = model.path.stat().st_size
    if mode == "mlock" and not can_lock(3 * file_bytes):
        pytest.skip("RLIMIT_MEMLOCK is too low to lock two loads of the model")
    t = target(model)
    before = sha256(model.path)
    done = run_worker(model, mode, way)
    assert done.returncode >= 0, f"died by signal {-done.returncode}: {done.stderr[-2000:]}"
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    spanned = align_up(t.file_offset + t.nbytes, PAGE_BYTES) - align_down(t.file_offset, PAGE_BYTES)
    assert result["anon_before"] == 0, result  # the clean pages are the page cache's
    if way in RAISES:
        assert result["raised"] == RAISES[way], result
        assert result["anon_after"] == 0, result
    else:
        assert result["raised"] is None, result
        assert PAGE_BYTES <= result["anon_after"] <= spanned, result
        assert result["first_keeps_write"], result
    assert result["landed"], result  # what was written shows (unchanged where it raised)
    assert result["second_sees_file"], result
    if way == "from_numpy":
        assert "not writable" in done.stderr  # torch's warning; the write is safe anyway
    if mode == "mlock":
        assert result["locked"] >= t.nbytes, result
    assert sha256(model.path) == before
    original = model.path.read_bytes()[t.file_offset : t.file_offset + t.nbytes]
    with aiogguf.load_sync(model.path, mode=mode, n_gpu_layers=0) as again:
        assert bytes(again.raw(t.name)) == original


def test_numpy_views_and_raw_bytes_stay_read_only(model: SynthModel) -> None:
    """The numpy contract is unchanged: a mapped model's arrays are read-only and cannot
    be made writable; ``raw`` is a read-only memoryview; ``writable`` says False."""
    name = target(model).name
    with aiogguf.load_sync(model.path, mode="mmap", n_gpu_layers=0) as loaded:
        array = loaded.tensors[name]
        assert not array.flags.writeable
        with pytest.raises(ValueError, match="WRITEABLE"):
            array.setflags(write=True)
        assert loaded.raw(name).readonly
        assert not loaded.writable(name)


def test_a_mapping_the_kernel_will_not_make_copy_on_write_is_read_only(
    model: SynthModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the kernel charges a private writable mapping and refuses it (ENOMEM:
    ``vm.overcommit_memory=2``, ``RLIMIT_DATA``), the load maps the ranges shared and
    read-only and goes on; torch tensors, which would be writable over read-only pages,
    are refused with a ``LoadError`` that says why and what to do."""
    real_mmap = mmap.mmap

    def charged(fd: int, length: int, **kwargs: Any) -> mmap.mmap:
        if kwargs.get("flags", 0) & mmap.MAP_PRIVATE:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return real_mmap(fd, length, **kwargs)

    monkeypatch.setattr(mapping_module.mmap, "mmap", charged)
    t = target(model)
    with aiogguf.load_sync(model.path, mode="mmap", n_gpu_layers=0) as loaded:
        images = [image for image in loaded._images if isinstance(image, MappedImage)]
        assert images
        assert not any(m.copy_on_write for image in images for m in image.mappings)
        original = model.path.read_bytes()[t.file_offset : t.file_offset + t.nbytes]
        assert bytes(loaded.raw(t.name)) == original
        assert not loaded.tensors[t.name].flags.writeable
        with pytest.raises(LoadError, match="refused a copy-on-write mapping") as refused:
            loaded.torch(t.name)
        assert 'mode="none"' in str(refused.value)
        assert str(model.path) in str(refused.value)
        with pytest.raises(LoadError, match="refused a copy-on-write mapping"):
            loaded.torch_tensors()


def test_a_mapping_larger_than_memory_is_copy_on_write(tmp_path: Path) -> None:
    """``MAP_NORESERVE``: a private writable mapping is otherwise charged in full, and
    the kernel's heuristic refuses one larger than RAM plus swap; a model larger than
    memory then maps (copy-on-write), as it did shared."""
    with open("/proc/sys/vm/overcommit_memory") as f:
        if f.read().strip() == "2":
            pytest.skip("strict overcommit charges every private writable mapping")
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    size = info["MemTotal"] + info["SwapTotal"] + (1 << 30)
    path = tmp_path / "sparse.bin"
    with open(path, "wb") as f:
        f.truncate(size)  # sparse: no block is written
    with open_mapping(path, 0, size) as mapping:
        assert mapping.copy_on_write
        assert mapping.nbytes == size


def _mapping_smaps(address: int) -> dict[str, int]:
    """Anonymous and Locked bytes of the mapping that starts at ``address``."""
    out: dict[str, int] = {}
    ours = False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if ":" not in fields[0]:
                ours = int(fields[0].split("-")[0], 16) == address
            elif ours and fields[0].rstrip(":") in ("Anonymous", "Locked"):
                out[fields[0].rstrip(":")] = int(fields[1]) * 1024
    return out


@pytest.mark.skipif(not can_lock(64 * PAGE_BYTES), reason="RLIMIT_MEMLOCK under 64 pages")
def test_lock_keeps_the_pages_the_page_cache_s_until_written(tmp_path: Path) -> None:
    """A plain ``mlock`` of a private writable mapping copies every page (the kernel
    breaks copy-on-write as it populates); ``lock`` locks on fault and reads the pages
    in instead: all locked, none copied. A write then copies exactly its page."""
    path = tmp_path / "data.bin"
    payload = np.random.default_rng(5).integers(0, 256, 32 * PAGE_BYTES, dtype=np.uint8)
    path.write_bytes(payload.tobytes())
    with open_mapping(path, 0, 32 * PAGE_BYTES) as mapping:
        result = mapping.lock()
        assert result.ok, result.problem
        assert _mapping_smaps(mapping.address) == {"Anonymous": 0, "Locked": 32 * PAGE_BYTES}
        mapping.private_view(5 * PAGE_BYTES + 1, 1)[0] ^= 0xFF
        assert _mapping_smaps(mapping.address) == {
            "Anonymous": PAGE_BYTES,
            "Locked": 32 * PAGE_BYTES,
        }
        assert bytes(mapping.view(5 * PAGE_BYTES + 1, 1)) == bytes(
            [payload[5 * PAGE_BYTES + 1] ^ 0xFF]
        )
    assert path.read_bytes() == payload.tobytes()


def test_lock_without_mlock2_locks_a_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``mlock2`` (glibc before 2.27, Linux before 4.4) only a plain ``mlock``
    locks: it copies the pages of a copy-on-write mapping into memory of the process's
    own (as mode ``none`` holds a model), and locks that. The file keeps its bytes."""
    path = tmp_path / "data.bin"
    path.write_bytes(b"\1" * (4 * PAGE_BYTES))
    monkeypatch.setattr(_libc, "_mlock2", None)
    with open_mapping(path, 0, 4 * PAGE_BYTES) as mapping:
        result = mapping.lock()
        assert result.ok, result.problem
        assert mapping.locked_bytes == 4 * PAGE_BYTES
        used = _mapping_smaps(mapping.address)
        assert used == {"Anonymous": 4 * PAGE_BYTES, "Locked": 4 * PAGE_BYTES}
        assert bytes(mapping.view(0, 4 * PAGE_BYTES)) == b"\1" * (4 * PAGE_BYTES)
    assert path.read_bytes() == b"\1" * (4 * PAGE_BYTES)


def test_torch_without_torch_says_how_to_install(
    model: SynthModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without torch, ``torch()`` and ``torch_tensors()`` raise ``ModuleNotFoundError``
    naming the extra to install, as gguf's and aiohttp's absence does (before: Python's
    bare "No module named 'torch'")."""
    monkeypatch.setitem(sys.modules, "torch", None)  # what an absent torch raises
    name = target(model).name
    with aiogguf.load_sync(model.path, mode="none", n_gpu_layers=0) as loaded:
        for call in (lambda: loaded.torch(name), loaded.torch_tensors):
            with pytest.raises(ModuleNotFoundError, match=r"pip install 'aiogguf\[torch\]'") as e:
                call()
            assert e.value.name == "torch"
