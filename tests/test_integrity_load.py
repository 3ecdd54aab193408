"""A load checked against its hash manifest while the bytes land (``load.manifest``).

Planted corruptions, each in every mode (``none``, ``direct``, ``mmap``, ``mlock``) and
through a simulated GPU: a bit flip in a quantized block, a zero-filled MiB, two blocks
swapped, a truncated-and-padded shard of a split set, a shard of another set with the
same shapes. Each fails the load with one error naming the bad tensors, the file, the
block and its offset; a clean model loads in every mode; a manifest of another model
is refused in one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers_gguf import write_gguf

# The model, its manifest and the split sets of the block checker's own tests.
from test_integrity import BLOCK, MiB, clean, clean_manifest, quantized, split_sets

import aiogguf
from aiogguf._dry_run import inspect_sync, plan_sync
from aiogguf._jobs import layout_buffers, split_jobs
from aiogguf.errors import (
    IntegrityError,
    LoadWarning,
    ManifestMismatchError,
    TensorValidationError,
)
from aiogguf.integrity._hashing import hash_model_sync
from aiogguf.integrity._manifest import Manifest, manifest_json
from aiogguf.integrity._sink import IntegritySink

__all__ = ["clean", "clean_manifest", "split_sets"]  # fixtures, shared

# Small jobs and slots, so that a job holds a few blocks and a model many jobs.
SMALL = {"chunk_size": "1MiB", "staging_buffer_size": "512KiB"}
MODES: dict[str, dict[str, Any]] = {
    "none": {"mode": "none", "n_gpu_layers": 0},
    "direct": {"mode": "direct", "n_gpu_layers": 0},
    "mmap": {"mode": "mmap", "n_gpu_layers": 0},
    "mlock": {"mode": "mlock", "n_gpu_layers": 0},
    "gpu": {"mode": "none", "sim_gpus": ["24GiB"], "n_gpu_layers": -1},
    "gpu_direct": {"mode": "direct", "sim_gpus": ["24GiB"], "n_gpu_layers": -1},
}


@pytest.fixture
def model(clean: Path, clean_manifest: Manifest, disk_dir: Path) -> Path:
    """A copy of the clean model (to damage), its manifest beside it."""
    path = Path(shutil.copyfile(clean, disk_dir / "m.gguf"))
    Path(f"{path}.manifest.json").write_text(manifest_json(clean_manifest))
    return path


def sidecar(path: Path) -> str:
    return f"{path}.manifest.json"


def load(path: Path, mode: str, **extra: Any) -> aiogguf.Model:
    """Load ``path`` in ``mode`` (closed at once), checked against its sidecar."""
    with warnings.catch_warnings():
        # mlock may be refused (RLIMIT_MEMLOCK), O_DIRECT by a filesystem: both warn.
        warnings.simplefilter("ignore", LoadWarning)
        settings = {**SMALL, **MODES[mode], "manifest": sidecar(path), **extra}
        with aiogguf.load_sync(path, **settings) as model:
            return model


def failed(path: Path, mode: str, **extra: Any) -> IntegrityError:
    with pytest.raises(IntegrityError) as info:
        load(path, mode, **extra)
    assert "\n" not in str(info.value)
    return info.value


def damage(path: Path, at: int, data: bytes) -> None:
    with path.open("r+b") as f:
        f.seek(at)
        f.write(data)


def block_of(manifest: Manifest, at: int, file_index: int = 0) -> tuple[int, int]:
    f = manifest.files[file_index]
    k = (at - f.header_bytes) // manifest.block_bytes
    return k, f.header_bytes + k * manifest.block_bytes


@pytest.mark.parametrize("mode", MODES)
def test_a_clean_model_loads_in_every_mode(
    model: Path, clean_manifest: Manifest, mode: str
) -> None:
    loaded = load(model, mode)
    assert loaded.failures == ()
    assert loaded.report.blocks_hashed == len(clean_manifest.files[0].blocks)
    assert load(model, mode, check_tensors=False).failures == ()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where", ["first", "quantized", "last"])
def test_a_bit_flip_is_found_and_named(
    model: Path, clean_manifest: Manifest, mode: str, where: str
) -> None:
    index = inspect_sync(model)
    name = {
        "first": index.tensors[0].name,
        "quantized": quantized(index),
        "last": index.tensors[-1].name,
    }[where]
    entry = index[name]
    at = entry.offset + entry.nbytes // 2 + 5
    damage(model, at, bytes([model.read_bytes()[at] ^ 0x10]))
    for checks in (True, False):
        error = failed(model, mode, check_tensors=checks)
        assert [f.name for f in error.failures] == [name]
        block, offset = block_of(clean_manifest, at)
        assert f"m.gguf block {block} at offset {offset}" in error.failures[0].problem


@pytest.mark.parametrize("mode", MODES)
def test_a_zero_filled_mib_names_every_tensor_it_touches(
    model: Path, clean_manifest: Manifest, mode: str
) -> None:
    index = inspect_sync(model)
    start = clean_manifest.files[0].header_bytes + 3 * BLOCK + 1000
    damage(model, start, bytes(MiB))
    touched = {t.name for t in index.tensors if t.offset < start + MiB and t.end > start}
    error = failed(model, mode, check_tensors=False)
    assert {f.name for f in error.failures} == touched
    first, offset = block_of(clean_manifest, start)
    assert f"m.gguf block {first} at offset {offset}" in " ".join(f.problem for f in error.failures)


@pytest.mark.parametrize("mode", MODES)
def test_two_swapped_blocks_are_found(model: Path, clean_manifest: Manifest, mode: str) -> None:
    index = inspect_sync(model)
    f = clean_manifest.files[0]
    a, b = f.header_bytes + 2 * BLOCK, f.header_bytes + 5 * BLOCK
    data = model.read_bytes()
    damage(model, a, data[b : b + BLOCK])
    damage(model, b, data[a : a + BLOCK])
    error = failed(model, mode)
    swapped = {
        t.name for t in index.tensors for lo in (a, b) if t.offset < lo + BLOCK and t.end > lo
    }
    assert {f.name for f in error.failures} == swapped
    problems = " ".join(f.problem for f in error.failures)
    assert f"block 2 at offset {a}" in problems or f"block 5 at offset {b}" in problems


@pytest.fixture
def split_model(split_sets: tuple[list[Path], list[Path]], disk_dir: Path) -> list[Path]:
    """A copy of the first set, its manifest beside its first file."""
    ours = [Path(shutil.copyfile(p, disk_dir / p.name)) for p in split_sets[0]]
    Path(sidecar(ours[0])).write_text(manifest_json(hash_model_sync(ours[0], block_bytes=BLOCK)))
    return ours


@pytest.mark.parametrize("mode", MODES)
def test_a_truncated_and_padded_shard_is_found(split_model: list[Path], mode: str) -> None:
    assert load(split_model[0], mode).failures == ()
    index = inspect_sync(split_model[0])
    shard = split_model[1]
    cut = shard.stat().st_size // 2
    # Cut short and zero-filled back to its size, as a preallocated download leaves it.
    damage(shard, cut, bytes(shard.stat().st_size - cut))
    error = failed(split_model[0], mode)
    lost = {t.name for t in index.tensors if t.file_index == 1 and t.end > cut}
    assert {f.name for f in error.failures} == lost
    assert shard.name in str(error)


@pytest.mark.parametrize("mode", MODES)
def test_a_shard_of_another_set_with_the_same_shapes_is_found(
    split_model: list[Path], split_sets: tuple[list[Path], list[Path]], mode: str
) -> None:
    index = inspect_sync(split_model[0])
    shutil.copyfile(split_sets[1][2], split_model[2])
    with pytest.raises((IntegrityError, ManifestMismatchError)) as info:
        load(split_model[0], mode)
    assert "\n" not in str(info.value)
    if isinstance(info.value, IntegrityError):
        shard_tensors = {t.name for t in index.tensors if t.file_index == 2}
        assert {f.name for f in info.value.failures} == shard_tensors
    assert split_model[2].name in str(info.value)


def test_a_manifest_of_another_model_is_refused_in_one_line(
    model: Path, split_model: list[Path]
) -> None:
    Path(sidecar(model)).write_text(Path(sidecar(split_model[0])).read_text())
    with pytest.raises(ManifestMismatchError) as info:
        load(model, "none")
    assert str(info.value) == (
        f"{sidecar(model)}: not a manifest of this model: it covers 3 files, the model has 1"
    )
    run = subprocess.run(
        [sys.executable, "-m", "aiogguf", "load", str(model), "--manifest", "auto"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1
    assert "not a manifest of this model" in run.stderr


def test_a_damaged_header_is_refused(model: Path, clean_manifest: Manifest) -> None:
    damage(model, 40, b"\xff")  # inside the first key's name
    with pytest.raises((ManifestMismatchError, aiogguf.GGUFError)):
        load(model, "none")


def test_auto_without_a_sidecar_checks_nothing(model: Path, clean_manifest: Manifest) -> None:
    Path(sidecar(model)).unlink()
    with aiogguf.load_sync(model, manifest="auto", n_gpu_layers=0) as loaded:
        assert loaded.failures == ()
    with pytest.raises(aiogguf.GGUFError):
        load(model, "none")  # an explicit path that is not there


def _llama_sidecar(path: Path, algorithms: tuple[str, ...]) -> None:
    from aiogguf.integrity._hashing import hash_model_llama_sync
    from aiogguf.integrity._llama_hash import format_llama

    text = format_llama(hash_model_llama_sync(path, algorithms=algorithms))
    Path(sidecar(path)).write_text(text)


def test_a_llama_manifest_of_another_model_is_refused_in_one_line(model: Path) -> None:
    Path(sidecar(model)).write_text("xxh64     0123456789abcdef  m.gguf:token_embd.weight\n")
    with pytest.raises(ManifestMismatchError) as info:
        load(model, "none")
    assert "\n" not in str(info.value)
    assert "not a manifest of this model" in str(info.value)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("algorithms", [("xxh64",), ("sha256", "sha1")])
def test_a_llama_manifest_is_checked_during_the_load(
    model: Path, mode: str, algorithms: tuple[str, ...]
) -> None:
    """A ``llama-gguf-hash`` manifest (gguf-py's script writes sha1/sha256; llama.cpp's
    tool xxh64 by default): a clean model loads; one bit flipped in two tensors names
    both, by the line of the manifest that differs."""
    _llama_sidecar(model, algorithms)
    load(model, mode)
    index = inspect_sync(model)
    bad = [quantized(index), index.tensors[-1].name]
    for name in bad:
        t = index[name]
        damage(
            model,
            t.offset + t.nbytes // 2,
            bytes([model.read_bytes()[t.offset + t.nbytes // 2] ^ 4]),
        )
    error = failed(model, mode)
    assert sorted(f.name for f in error.failures) == sorted(bad)
    assert all("differs from line" in f.problem for f in error.failures)


def test_keep_invalid_returns_the_model_with_every_bad_tensor(model: Path) -> None:
    index = inspect_sync(model)
    bad = [index.tensors[1], index.tensors[-1]]
    for t in bad:
        damage(model, t.offset + 3, bytes([model.read_bytes()[t.offset + 3] ^ 0xFF]))
    loaded = load(model, "none", keep_invalid=True)
    assert {f.name for f in loaded.failures} >= {t.name for t in bad}
    with pytest.raises(TensorValidationError) as info:
        load(model, "gpu")
    assert {f.name for f in info.value.failures} >= {t.name for t in bad}


@pytest.mark.parametrize("aligned", [False, True])
def test_jobs_are_cut_at_block_boundaries(clean: Path, aligned: bool) -> None:
    """Every job's useful bytes but a range's last end at a block boundary, so that a
    block lies inside one job but at a range's edges; an aligned job's read reaches
    the alignment unit around it, and stays within the job size."""
    index = inspect_sync(clean)
    plan = plan_sync(clean, n_gpu_layers=0)
    layouts = layout_buffers(plan, 4096)
    start = index.files[0].data_offset
    chunk = 3 * BLOCK + 8192
    jobs, _ = split_jobs(
        index,
        layouts,
        chunk,
        host_bytes=chunk,
        slot_bytes=None,
        aligned=aligned,
        blocks=[(start, BLOCK)],
        alignment=4096,
    )
    assert len(jobs[0]) > 2
    for job, after in zip(jobs[0], jobs[0][1:], strict=False):
        assert (job.useful_end - start) % BLOCK == 0
        assert after.useful_start == job.useful_end  # each byte counted once
        assert job.nbytes <= chunk
        if aligned:
            assert job.file_offset % 4096 == 0
            assert job.nbytes % 4096 == 0 or job is jobs[0][-1]
            assert job.file_offset <= job.useful_start
            assert job.useful_end <= job.file_offset + job.nbytes
    last = jobs[0][-1]
    assert last.useful_end == max(t.end for t in index.tensors)


def test_pieces_overlap_so_each_block_of_a_job_lies_in_one(clean: Path) -> None:
    """The reader's pieces overlap by one piece: any block inside a job lies wholly in
    one of them, wherever the job starts."""
    from aiogguf.stages.read import CHECK_PIECE_BYTES as P

    for useful in (P - 1, P, 3 * P + 17):
        pieces = [(max(lo - P, 0), min(lo + P, useful)) for lo in range(0, useful, P)]
        for b in range(0, useful - BLOCK, BLOCK // 3):
            assert any(lo <= b and b + BLOCK <= hi for lo, hi in pieces)


@pytest.mark.parametrize("mode", MODES)
def test_blocks_are_hashed_as_they_land(
    model: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the blocks at a range's edges are left for the end of the load: the rest
    were hashed as they landed."""
    left: list[int] = []
    finish = IntegritySink.finish

    def counted(sink: IntegritySink) -> None:
        left.append(len(sink.edges()))
        finish(sink)

    monkeypatch.setattr(IntegritySink, "finish", counted)
    load(model, mode)
    plan = plan_sync(model, **MODES[mode])
    ranges = sum(len(b.ranges) for b in plan.buffers if not b.lazy)
    blocks = len(hash_model_sync(model, block_bytes=BLOCK).files[0].blocks)
    edges_at_most = 2 * ranges
    assert len(left) == 1
    assert left[0] <= edges_at_most, (left, ranges, blocks)


@pytest.mark.parametrize("mode", MODES)
def test_every_block_is_checked(
    model: Path, clean_manifest: Manifest, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A byte changed in every block, at its start: each block is found, the edges too."""
    f = clean_manifest.files[0]
    data = bytearray(model.read_bytes())
    for at in range(f.header_bytes, f.data_end, BLOCK):
        data[at] ^= 0x01
    model.write_bytes(data)
    seen: list[set[int]] = []
    error = IntegritySink.error

    def record(sink: IntegritySink, path: str | None) -> IntegrityError | None:
        found = error(sink, path)
        seen.append({m.block for m in sink.mismatches})
        return found

    monkeypatch.setattr(IntegritySink, "error", record)
    failed(model, mode)
    assert seen == [set(range(len(f.blocks)))]


def test_the_commands_name_the_bad_tensor(model: Path) -> None:
    command = [sys.executable, "-m", "aiogguf"]
    run = subprocess.run(
        [*command, "load", str(model), "--manifest", "-ngl", "0"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert "24 blocks match the manifest" in run.stdout
    index = inspect_sync(model)
    name = quantized(index)
    at = index[name].offset + 11
    damage(model, at, bytes([model.read_bytes()[at] ^ 0x40]))
    for argv in (["load", str(model), "--manifest"], ["load", str(model), "--no-check"]):
        run = subprocess.run([*command, *argv], capture_output=True, text=True, check=False)
        if argv[-1] == "--manifest":
            assert run.returncode == 2
            assert run.stderr.count("\n") == 1
            assert name in run.stderr
        else:
            assert run.returncode == 0  # no manifest asked for: nothing checks the bytes
    run = subprocess.run(
        [*command, "validate", str(model), "--manifest", sidecar(model), "-ngl", "0"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert run.returncode == 2
    assert name in run.stdout


def test_the_manifest_is_opened_through_the_loads_opener(
    model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    outside = tmp_path_factory.mktemp("outside") / "m.json"
    outside.write_text(Path(sidecar(model)).read_text())
    with aiogguf.RootedOpener([model.parent]) as opener:
        with aiogguf.load_sync(model, opener=opener, manifest="auto", n_gpu_layers=0) as loaded:
            assert loaded.failures == ()
        with (
            pytest.raises(aiogguf.PathNotAllowedError),
            aiogguf.load_sync(model, opener=opener, manifest=outside, n_gpu_layers=0),
        ):
            pass


@pytest.mark.parametrize("mode", MODES)
def test_a_big_endian_model_is_checked_as_its_file_holds_it(disk_dir: Path, mode: str) -> None:
    """Its bytes are swapped as they land: the blocks are hashed from the file."""
    rng = np.random.default_rng(5)
    kv = {"general.architecture": "llama", "llama.block_count": np.uint32(1)}
    tensors = [
        (f"blk.0.{name}.weight", rng.standard_normal((128, 256), dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "ffn_up")
    ]
    path = write_gguf(disk_dir / "be.gguf", kv, tensors, endian="big")
    Path(sidecar(path)).write_text(manifest_json(hash_model_sync(path, block_bytes=64 << 10)))
    assert load(path, mode, chunk_size="192KiB", staging_buffer_size="128KiB").failures == ()
    entry = inspect_sync(path)["blk.0.attn_k.weight"]
    damage(path, entry.offset + 1000, bytes([path.read_bytes()[entry.offset + 1000] ^ 4]))
    error = failed(path, mode, chunk_size="192KiB", staging_buffer_size="128KiB")
    assert [f.name for f in error.failures] == [entry.name]


def _float_tensors(path: Path) -> list[Any]:
    return [t for t in inspect_sync(path).tensors if t.type.name in ("F32", "F16")]


@pytest.mark.parametrize("mode", ["mmap", "mlock"])
def test_a_mapped_load_reads_its_file_once_for_the_manifest_and_the_checks(
    model: Path, clean_manifest: Manifest, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checks of mapped tensors take their bytes from the manifest's reads of the
    file: the data section is read about once, not once per consumer."""
    from aiogguf.io.files import DataFile

    read = [0]
    read_into = DataFile.read_into

    def counted(self: DataFile, dest: Any, offset: int) -> None:
        read[0] += len(memoryview(dest).cast("B"))
        read_into(self, dest, offset)

    monkeypatch.setattr(DataFile, "read_into", counted)
    load(model, mode)
    f = clean_manifest.files[0]
    data = f.data_end - f.header_bytes
    # The headers (fingerprint) and the straddling units of the edges are read twice.
    assert data <= read[0] < data + 4 * BLOCK, (read[0], data)


@pytest.mark.parametrize("mode", ["mmap", "mlock"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_mapped_load_with_a_manifest_still_names_every_bad_value(
    model: Path, mode: str, where: str
) -> None:
    """A NaN the manifest agrees with (it was there when the manifest was made) is found
    by the checks, whether its unit came from the manifest's reads or was read back at the
    end (the edges of a range)."""
    floats = _float_tensors(model)
    t = {"first": floats[0], "middle": floats[len(floats) // 2], "last": floats[-1]}[where]
    nan = np.array([np.nan], dtype=np.float32 if t.type.name == "F32" else np.float16)
    damage(model, t.offset + (t.nbytes // 2 // nan.itemsize) * nan.itemsize, nan.tobytes())
    Path(sidecar(model)).write_text(manifest_json(hash_model_sync(model, block_bytes=BLOCK)))
    with pytest.raises(TensorValidationError) as info:
        load(model, mode)
    assert not isinstance(info.value, IntegrityError)
    assert [f.name for f in info.value.failures] == [t.name]


def test_a_local_buffered_load_hashes_each_block_as_its_reads_land(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mode none: the reader hands each read to the hash as it lands (``stream``), so
    only the blocks that span two jobs are hashed again whole, from memory."""
    from aiogguf._core import layout
    from aiogguf.integrity._checker import IntegrityChecker

    monkeypatch.setattr(layout, "usable_cores", lambda: 2)  # readers on every core
    whole: list[int] = []
    check_piece = IntegrityChecker.check_piece

    def counted(checker: IntegrityChecker, file_index: int, at: int, data: Any) -> Any:
        whole.append(at)
        return check_piece(checker, file_index, at, data)

    monkeypatch.setattr(IntegrityChecker, "check_piece", counted)
    loaded = load(model, "none", readers=2)
    blocks = len(hash_model_sync(model, block_bytes=BLOCK).files[0].blocks)
    jobs = loaded.report.files[0].reads
    assert loaded.report.blocks_hashed == blocks >= 2 * jobs > 0
    assert len(whole) <= jobs  # at most one block across each job's end
