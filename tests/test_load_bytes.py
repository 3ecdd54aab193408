"""End to end: every tensor a load puts in memory holds exactly the file's bytes.

Oracle: ``gguf.GGUFReader`` (llama.cpp's own Python reader) and the raw file bytes at
its offsets, for every reference file made by llama.cpp and for synthetic files of every
ggml type, in each load mode, single files and split sets. Also the shapes and dtypes of
``model.tensors`` and the byte order conversion of big-endian files.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from conftest import REFERENCE_DIR, reference_files
from gguf_oracle import ReaderTensor, reference_reader
from helpers_gguf import write_gguf

import aiogguf
from aiogguf.errors import BigEndianError, SplitError
from aiogguf.io.ggml_types import GGML_TYPES
from aiogguf.testing.synth import SynthModel, write_synthetic_model

MODES = ("mmap", "mlock", "none", "direct")
SPLIT_FIRST = "tiny-llama-Q4_K_M-split-00001-of-00003.gguf"
# A low RLIMIT_MEMLOCK turns mlock into a LoadWarning ("goes on unlocked"): still a load.
mlock_ok = pytest.mark.filterwarnings("ignore::aiogguf.errors.LoadWarning")


def _mode_params() -> list[Any]:
    return [pytest.param(m, marks=mlock_ok) if m == "mlock" else m for m in MODES]


def _single_reference_files() -> list[str]:
    """Reference files that load on their own: all but the later shards of the split."""
    return [n for n in reference_files() if "-split-" not in n or n == SPLIT_FIRST]


@dataclass(frozen=True, slots=True)
class Expected:
    """One tensor as GGUFReader sees it, plus the file bytes at its offset."""

    data: bytes  # the reader's array as bytes
    at_offset: bytes  # the file's bytes at the reader's data_offset
    type_id: int
    dims: tuple[int, ...]  # ggml order
    reader_shape: tuple[int, ...]


@functools.cache
def oracle(paths: tuple[Path, ...]) -> dict[str, Expected]:
    """name → ``Expected`` over every file of a (split) model (GGUFReader is slow: once;
    the reference files' reading is shared with other modules)."""
    out: dict[str, Expected] = {}
    for path in paths:
        if path.is_relative_to(REFERENCE_DIR):
            tensors = reference_reader(path).tensors
        else:
            tensors = tuple(
                ReaderTensor(
                    t.name,
                    int(t.tensor_type),
                    tuple(int(d) for d in t.shape),
                    int(t.data_offset),
                    int(t.n_bytes),
                    np.asarray(t.data),
                )
                for t in gguf.GGUFReader(path).tensors
            )
        for t in tensors:
            assert t.name not in out
            out[t.name] = Expected(
                data=t.data.view(np.uint8).tobytes(),
                at_offset=file_bytes(path, t.data_offset, t.n_bytes),
                type_id=t.type_id,
                dims=t.dims,
                reader_shape=t.data.shape,
            )
    return out


def file_bytes(path: Path, offset: int, nbytes: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(nbytes)


def assert_same_bytes(model: aiogguf.Model, paths: Sequence[Path]) -> None:
    """Every tensor's bytes equal the reader's data and the file's bytes at its offset."""
    expected = oracle(tuple(paths))
    assert set(model.tensors) == set(expected)
    assert model.report.nbytes == sum(len(e.data) for e in expected.values())
    for name, e in expected.items():
        got = bytes(model.raw(name))
        assert got == e.data, f"{name}: bytes differ from GGUFReader's"
        assert got == e.at_offset, f"{name}: bytes differ from the file's"
        assert model.tensors[name].tobytes() == got, name


def assert_shapes(model: aiogguf.Model, paths: Sequence[Path]) -> None:
    """Plain types: the reversed ggml shape with the element dtype (= the reader's
    array); quantized: uint8 ``(..., ne1, ne0 / block_elems, block_bytes)``."""
    for name, e in oracle(tuple(paths)).items():
        array = model.tensors[name]
        ggml = GGML_TYPES[e.type_id]
        assert isinstance(array, np.ndarray)
        if ggml.element_dtype is not None:
            assert array.shape == tuple(reversed(e.dims)), name
            assert array.dtype == np.dtype(ggml.element_dtype), name
            if ggml.name != "BF16":  # the reader gives BF16 as bytes: (..., 2 * ne0)
                assert array.shape == e.reader_shape, name
        else:
            assert array.dtype == np.uint8, name
            outer = tuple(reversed(e.dims[1:]))
            assert array.shape == (*outer, e.dims[0] // ggml.block_elems, ggml.block_bytes), name
            assert array.reshape(e.reader_shape).tobytes() == e.data, name


# --- reference files (made by llama.cpp) -------------------------------------------------


@pytest.mark.parametrize("mode", _mode_params())
@pytest.mark.parametrize("name", _single_reference_files())
def test_reference_file_bytes(reference_dir: Path, name: str, mode: str) -> None:
    path = reference_dir / name
    paths = (
        sorted(reference_dir.glob("tiny-llama-Q4_K_M-split-*.gguf"))
        if name == SPLIT_FIRST
        else [path]
    )
    with aiogguf.load_sync(path, mode=mode, n_gpu_layers=0) as model:
        assert model.report.mode == mode
        assert model.report.n_tensors == len(model.tensors)
        assert_same_bytes(model, paths)
        if mode == "none":
            assert_shapes(model, paths)


def test_reference_split_equals_unsplit(reference_dir: Path) -> None:
    """The split set loads to exactly the tensors of the file it was cut from."""
    with (
        aiogguf.load_sync(reference_dir / SPLIT_FIRST, mode="none", n_gpu_layers=0) as split,
        aiogguf.load_sync(
            reference_dir / "tiny-llama-Q4_K_M.gguf", mode="mmap", n_gpu_layers=0
        ) as whole,
    ):
        assert list(split.tensors)
        assert set(split.tensors) == set(whole.tensors)
        for name in whole.tensors:
            assert bytes(split.raw(name)) == bytes(whole.raw(name)), name
        assert split.metadata["general.architecture"] == "llama"


def test_later_shard_alone_is_refused(reference_dir: Path) -> None:
    later = reference_dir / "tiny-llama-Q4_K_M-split-00002-of-00003.gguf"
    with (
        pytest.raises(SplitError, match="00001-of-00003"),
        aiogguf.load_sync(later, n_gpu_layers=0),
    ):
        pass


# --- synthetic files of every type ------------------------------------------------------


@pytest.fixture(scope="module")
def all_types(tmp_path_factory: pytest.TempPathFactory) -> SynthModel:
    """Every ggml type GGUFReader knows (Q2_0 excluded: the reader refuses id 42)."""
    path = tmp_path_factory.mktemp("all") / "all.gguf"
    return write_synthetic_model(path, size_bytes="3MiB", types="all-types", include_q2_0=False)


@pytest.fixture(scope="module")
def all_types_q2_0(tmp_path_factory: pytest.TempPathFactory) -> SynthModel:
    path = tmp_path_factory.mktemp("q20") / "q20.gguf"
    return write_synthetic_model(path, size_bytes="2MiB", types="all-types", seed=3)


@pytest.fixture(scope="module")
def split_model(tmp_path_factory: pytest.TempPathFactory) -> SynthModel:
    path = tmp_path_factory.mktemp("split") / "s.gguf"
    return write_synthetic_model(
        path, size_bytes="4MiB", types="all-types", include_q2_0=False, split_count=3, seed=7
    )


@pytest.mark.parametrize("mode", _mode_params())
def test_every_type_bytes_and_shapes(all_types: SynthModel, mode: str) -> None:
    wanted = {GGML_TYPES[t.type_id].name for t in all_types.tensors}
    assert {"F32", "F16", "BF16", "F64", "I8", "Q4_K", "IQ1_M", "TQ2_0", "MXFP4"} <= wanted
    with aiogguf.load_sync(all_types.path, mode=mode, n_gpu_layers=0) as model:
        assert_same_bytes(model, [all_types.path])
        assert_shapes(model, [all_types.path])


@pytest.mark.parametrize("mode", _mode_params())
def test_q2_0_bytes_from_the_writers_record(all_types_q2_0: SynthModel, mode: str) -> None:
    """Q2_0 (which GGUFReader cannot read): the file bytes at the writer's offsets."""
    path = all_types_q2_0.path
    with aiogguf.load_sync(path, mode=mode, n_gpu_layers=0) as model:
        assert len(model.tensors) == all_types_q2_0.n_tensors
        for t in all_types_q2_0.tensors:
            assert bytes(model.raw(t.name)) == file_bytes(path, t.file_offset, t.nbytes), t.name
        (q2,) = all_types_q2_0.tensors_of_type("Q2_0")
        ggml = GGML_TYPES[q2.type_id]
        assert model.tensors[q2.name].shape[-1] == ggml.block_bytes


@pytest.mark.parametrize("mode", _mode_params())
def test_synthetic_split_bytes(split_model: SynthModel, mode: str) -> None:
    assert len(split_model.paths) == 3
    with aiogguf.load_sync(split_model.path, mode=mode, n_gpu_layers=0) as model:
        assert_same_bytes(model, split_model.paths)
        assert len(model.report.files) == 3
        for record, path in zip(model.report.files, split_model.paths, strict=True):
            assert Path(record.path) == path
        per_file = [sum(t.nbytes for t in split_model.tensors if t.shard == i) for i in range(3)]
        assert [f.nbytes for f in model.report.files] == per_file


def test_chunking_does_not_change_bytes(split_model: SynthModel) -> None:
    """Reads cut into many small chunks (crossing tensor bounds) land the same bytes."""
    for mode in ("none", "direct"):
        with aiogguf.load_sync(
            split_model.path, mode=mode, chunk_size="64KiB", n_gpu_layers=0
        ) as model:
            assert_same_bytes(model, split_model.paths)
            assert sum(f.reads for f in model.report.files) > 4 * 1024**2 // (64 * 1024) // 2


# --- big-endian files -------------------------------------------------------------------


def _twin_tensors(endian: str) -> list[tuple[str, Any]]:
    """The same values for both files: numpy arrays (the writer swaps them for a
    big-endian file) and a BF16 tensor as raw bytes in the file's byte order."""
    rng = np.random.default_rng(11)
    bf16 = (rng.standard_normal(4096).astype(np.float32).view(np.uint32) >> 16).astype("<u2")
    bf16_raw = bf16.astype(">u2" if endian == "big" else "<u2").tobytes()
    return [
        ("token_embd.weight", rng.standard_normal((64, 256)).astype(np.float32)),
        ("blk.0.attn_q.weight", rng.standard_normal((128, 256)).astype(np.float16)),
        ("blk.0.attn_k.weight", rng.standard_normal((32, 64))),  # F64
        ("blk.0.attn_v.weight", rng.integers(-128, 127, (16, 128), dtype=np.int8)),
        ("blk.0.ffn_up.weight", rng.integers(-(2**15), 2**15, (16, 128), dtype=np.int16)),
        ("blk.0.ffn_gate.weight", rng.integers(-(2**31), 2**31, (16, 128), dtype=np.int32)),
        ("blk.0.ffn_down.weight", rng.integers(-(2**62), 2**62, (8, 128), dtype=np.int64)),
        ("output.weight", (bf16_raw, 30, (16, 256))),
    ]


@pytest.fixture(scope="module")
def endian_twins(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("endian")
    kv = {"general.architecture": "llama", "llama.block_count": np.uint32(1)}
    little = write_gguf(d / "le.gguf", kv, _twin_tensors("little"))
    big = write_gguf(d / "be.gguf", kv, _twin_tensors("big"), endian="big")
    return little, big


@pytest.mark.parametrize("mode", _mode_params())
def test_big_endian_values_equal_little_endian_twin(
    endian_twins: tuple[Path, Path], mode: str
) -> None:
    little, big = endian_twins
    before = big.read_bytes()
    with (
        aiogguf.load_sync(little, mode="none", n_gpu_layers=0) as le,
        aiogguf.load_sync(big, mode=mode, n_gpu_layers=0) as be,
    ):
        assert len(be.tensors) == 8
        for name in le.tensors:
            entry = be.index[name]
            on_disk = np.frombuffer(file_bytes(big, entry.offset, entry.nbytes), np.uint8)
            itemsize = (
                2 if entry.type.name == "BF16" else np.dtype(entry.type.element_dtype).itemsize
            )
            swapped = on_disk.reshape(-1, itemsize)[:, ::-1].tobytes()
            # The loader swapped the file's big-endian elements to native order, which
            # are the little-endian twin's values, bit for bit.
            assert bytes(be.raw(name)) == swapped, name
            assert bytes(be.raw(name)) == bytes(le.raw(name)), name
            assert be.tensors[name].dtype == le.tensors[name].dtype
            np.testing.assert_array_equal(be.tensors[name], le.tensors[name])
    # The file itself is untouched (mmap swaps in private pages, never in the page cache).
    assert big.read_bytes() == before


@pytest.mark.parametrize("mode", ["mmap", "direct"])
def test_big_endian_synthetic_model_is_swapped(tmp_path: Path, mode: str) -> None:
    m = write_synthetic_model(tmp_path / "be.gguf", size_bytes="1MiB", big_endian=True, seed=2)
    with aiogguf.load_sync(m.path, mode=mode, n_gpu_layers=0) as model:
        for t in m.tensors:
            dtype = np.dtype(GGML_TYPES[t.type_id].element_dtype or "u2")
            on_disk = np.frombuffer(file_bytes(m.path, t.file_offset, t.nbytes), np.uint8)
            assert (
                bytes(model.raw(t.name)) == on_disk.reshape(-1, dtype.itemsize)[:, ::-1].tobytes()
            )


@pytest.mark.parametrize("mode", ["mmap", "none"])
def test_big_endian_quantized_file_is_refused(tmp_path: Path, mode: str) -> None:
    m = write_synthetic_model(tmp_path / "q.gguf", size_bytes="1MiB", types="Q4_K", big_endian=True)
    (first_q4k, *_) = m.tensors_of_type("Q4_K")
    with (
        pytest.raises(BigEndianError) as info,
        aiogguf.load_sync(m.path, mode=mode, n_gpu_layers=0),
    ):
        pass
    message = str(info.value)
    assert "Q4_K" in message
    assert f"'{first_q4k.name}'" in message or any(f"'{t.name}'" in message for t in m.tensors)
    assert str(m.path) in message
