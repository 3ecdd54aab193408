"""``aiogguf.compat._reader.GGUFReader`` passes the assertions gguf-py's ``GGUFReader`` passes.

Each file is read by both readers, and the same function checks each against an oracle
of its own: MANIFEST.json (keys, values, tensor names, types, shapes, offsets, sizes)
for llama.cpp's reference files, the writer's record (``SynthModel``) for synthetic
ones, and the file's bytes read with plain ``open`` for every tensor's data. Then the
two readers are compared part by part: every field's ``parts``, ``data`` and ``types``,
every tensor's attributes and data (dtype, shape, bytes).
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
from conftest import REFERENCE_DIR

import aiogguf
from aiogguf.errors import GGUFError, GGUFFormatError, LoadError, TensorValidationError
from aiogguf.testing.synth import Corruption, CorruptionKind, SynthModel, write_synthetic_model

gguf = pytest.importorskip("gguf")
from helpers_gguf import write_gguf  # noqa: E402

from aiogguf.compat._reader import (  # noqa: E402 - needs gguf, as the skip says
    CompatFormatError,
    CompatOSError,
    GGUFReader,
)

NAMES = sorted(p.name for p in REFERENCE_DIR.glob("*.gguf")) or ["<missing>"]
READERS: dict[str, Callable[[Path], Any]] = {"gguf-py": gguf.GGUFReader, "aiogguf": GGUFReader}
Q = gguf.GGMLQuantizationType


def file_bytes(path: Path, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


def check_reader(
    reader: Any, path: Path, data_offset: int, kv: dict[str, Any], tensors: list[dict[str, Any]]
) -> None:
    """What a user of gguf-py's reader relies on, against an oracle of the file.
    ``tensors``: name, type, ne (ggml order), offset (in the data section), n_bytes."""
    assert reader.data_offset == data_offset
    assert reader.byte_order == "I"
    assert list(reader.fields)[:3] == ["GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"]
    assert reader.get_field("GGUF.tensor_count").contents() == len(tensors)
    assert reader.get_field("no.such.key") is None
    for key, want in kv.items():
        field = reader.get_field(key)
        assert field.name == key
        if isinstance(want, dict):  # an array: its item type and length
            assert field.types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType[want["array_of"]]]
            assert len(field.data) == want["len"] == len(field.contents())
            if want["array_of"] == "STRING":
                assert field.contents(0) == str(field.parts[field.data[0]].tobytes(), "utf-8")
        else:
            assert field.contents() == want, key
    assert [t.name for t in reader.tensors] == [t["name"] for t in tensors]
    dequantized: set[int] = set()
    for i, (got, want) in enumerate(zip(reader.tensors, tensors, strict=True)):
        assert reader.get_tensor(i) is got
        assert got.tensor_type == Q[want["type"]]
        assert got.shape.tolist() == want["ne"]
        assert got.n_elements == int(np.prod(want["ne"]))
        assert got.n_bytes == want["n_bytes"] == got.data.nbytes
        assert got.data_offset == data_offset + want["offset"]
        assert got.field.name == got.name
        assert got.data.tobytes() == file_bytes(path, got.data_offset, got.n_bytes), got.name
        if got.tensor_type not in dequantized and got.n_elements <= 1 << 16:
            dequantized.add(got.tensor_type)
            try:
                values = gguf.quants.dequantize(got.data, got.tensor_type)
            except NotImplementedError:  # gguf-py has no kernel for a few (Q8_K)
                continue
            assert values.shape == tuple(reversed(want["ne"])), got.name


def compare(ours: GGUFReader, theirs: Any) -> None:
    assert (ours.alignment, ours.data_offset, ours.endianess) == (
        theirs.alignment,
        theirs.data_offset,
        theirs.endianess,
    )
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.offset, mine.name, mine.data, mine.types) == (
            field.offset,
            field.name,
            field.data,
            field.types,
        ), key
        assert len(mine.parts) == len(field.parts), key
        for a, b in zip(mine.parts, field.parts, strict=True):
            assert a.dtype == b.dtype, key
            assert np.array_equal(a, b), key
    for mine, tensor in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.name == tensor.name
        assert (mine.tensor_type, mine.n_elements, mine.n_bytes, mine.data_offset) == (
            tensor.tensor_type,
            tensor.n_elements,
            tensor.n_bytes,
            tensor.data_offset,
        )
        assert mine.shape.dtype == tensor.shape.dtype
        assert (mine.data.dtype, mine.data.shape) == (tensor.data.dtype, tensor.data.shape)
        assert mine.data.tobytes() == tensor.data.tobytes()
        assert mine.field.parts[3].tolist() == tensor.field.parts[3].tolist()


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("name", NAMES)
def test_reference_files(name: str, reader: str, reference_dir: Path, manifest: Any) -> None:
    entry = {e["file"]: e for e in manifest}[name]
    path = reference_dir / name
    check_reader(
        READERS[reader](path), path, entry["tensor_data_offset"], entry["kv"], entry["tensors"]
    )


@pytest.mark.parametrize("name", NAMES)
def test_reference_files_part_by_part(name: str, reference_dir: Path) -> None:
    compare(GGUFReader(reference_dir / name), gguf.GGUFReader(reference_dir / name))


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> SynthModel:
    # gguf 0.19's reader refuses Q2_0 (id 42): the file both can read.
    folder = tmp_path_factory.mktemp("compat")
    return write_synthetic_model(
        folder / "all.gguf", size_bytes="2MiB", seed=11, types="all-types", include_q2_0=False
    )


@pytest.mark.parametrize("reader", READERS)
def test_synthetic_every_type(synth: SynthModel, reader: str) -> None:
    data_offset = synth.tensors[0].file_offset - synth.tensors[0].offset
    tensors = [
        {"name": t.name, "type": t.type_name, "ne": list(t.shape), "offset": t.offset}
        | {"n_bytes": t.nbytes}
        for t in synth.tensors
    ]
    kv = {"general.architecture": "llama", "llama.block_count": synth.n_layer}
    kv["tokenizer.ggml.tokens"] = {"array_of": "STRING", "len": synth.n_vocab}
    check_reader(READERS[reader](synth.path), synth.path, data_offset, kv, tensors)


def test_synthetic_part_by_part(synth: SynthModel) -> None:
    compare(GGUFReader(synth.path), gguf.GGUFReader(synth.path))


def test_modes(synth: SynthModel) -> None:
    """'r' maps the file read-only (as gguf-py's 'r'), 'c' gives writable memory of the
    process's own (as gguf-py's copy-on-write 'c'); 'r+' would write into the file."""
    name = synth.tensors_of_type("F32")[0].name
    mapped = {t.name: t for t in GGUFReader(synth.path).tensors}[name]
    assert not mapped.data.flags.writeable
    copied = {t.name: t for t in GGUFReader(synth.path, "c").tensors}[name]
    copied.data[...] = 1.0
    fresh = {t.name: t for t in GGUFReader(synth.path).tensors}[name]
    assert fresh.data.tobytes() == mapped.data.tobytes() != copied.data.tobytes()
    with pytest.raises(ValueError, match="'r\\+'"):
        GGUFReader(synth.path, "r+")


def test_the_pipeline_checks_what_gguf_py_hands_over(tmp_path: Path) -> None:
    """The data comes through aiogguf's load: a NaN planted in a tensor is an error
    naming it (gguf-py hands the bytes over); ``check_tensors=False`` reads it as is."""
    clean = write_synthetic_model(tmp_path / "m.gguf", size_bytes="1MiB", seed=2, n_layer=2)
    target = clean.tensors_of_type("F32")[0].name
    bad = write_synthetic_model(
        tmp_path / "bad.gguf",
        size_bytes="1MiB",
        seed=2,
        n_layer=2,
        corruptions=[Corruption(target, CorruptionKind.INF_ELEMENT, index=3)],
    )
    assert len(gguf.GGUFReader(bad.path).tensors) == clean.n_tensors
    with pytest.raises(TensorValidationError, match=target):
        GGUFReader(bad.path)
    assert len(GGUFReader(bad.path, check_tensors=False).tensors) == clean.n_tensors


def test_gguf_py_class_attributes() -> None:
    """What gguf-py's scripts read from the class: ``gguf_dump.py`` tells a scalar field
    from the others with ``gguf_scalar_to_np``, ``gguf_set_metadata.py`` converts the
    new value with it."""
    assert GGUFReader.gguf_scalar_to_np == gguf.GGUFReader.gguf_scalar_to_np
    assert GGUFReader.gguf_scalar_to_np is not gguf.GGUFReader.gguf_scalar_to_np
    assert (GGUFReader.byte_order, GGUFReader.alignment) == (
        gguf.GGUFReader.byte_order,
        gguf.GGUFReader.alignment,
    )


def _tiny(path: Path) -> Path:
    return write_gguf(
        path,
        {"general.architecture": "llama", "llama.block_count": np.uint32(2)},
        [("a.weight", np.ones((2, 32), np.float32)), ("b.weight", np.ones((2, 32), np.float32))],
    )


def _damaged(tmp_path: Path, edit: Callable[[bytes], bytes]) -> Path:
    good = _tiny(tmp_path / "good.gguf").read_bytes()
    path = tmp_path / "bad.gguf"
    path.write_bytes(edit(good))
    return path


def _after(marker: bytes, skip: int, new: bytes) -> Callable[[bytes], bytes]:
    """An edit: ``new`` written ``skip`` bytes after the end of ``marker``."""

    def edit(buf: bytes) -> bytes:
        at = buf.index(marker) + len(marker) + skip
        return buf[:at] + new + buf[at + len(new) :]

    return edit


# name → a malformed file made from a good one; gguf-py's reader raises ValueError for
# each but "header cut short", where it raises IndexError (an index past its map).
MALFORMED: dict[str, Callable[[bytes], bytes]] = {
    "empty": lambda buf: b"",
    "bad magic": lambda buf: b"GGUX" + buf[4:],
    "version 9": lambda buf: buf[:4] + struct.pack("<I", 9) + buf[8:],
    "header cut short": lambda buf: buf[:40],
    "data cut short": lambda buf: buf[:-64],
    "value type 77": _after(b"llama.block_count", 0, struct.pack("<I", 77)),
    "tensor type 99": _after(b"b.weight", 4 + 16, struct.pack("<I", 99)),
    "duplicate tensor": _after(b"a.weight", 4 + 16 + 4 + 8 + 8, b"a.weight"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_file_is_a_value_error(case: str, tmp_path: Path) -> None:
    """What gguf-py raises (``ValueError``), and aiogguf's ``GGUFFormatError`` naming the
    file: ``except ValueError`` written for gguf-py's reader catches ours."""
    path = _damaged(tmp_path, MALFORMED[case])
    with pytest.raises(IndexError if case == "header cut short" else ValueError):
        gguf.GGUFReader(path)
    with pytest.raises(ValueError, match=re.escape(str(path))) as caught:
        GGUFReader(path)
    assert isinstance(caught.value, GGUFFormatError)
    assert isinstance(caught.value, CompatFormatError)
    with pytest.raises(GGUFError):
        GGUFReader(path)


def _missing(tmp_path: Path) -> Path:
    return tmp_path / "no-such.gguf"


def _dangling(tmp_path: Path) -> Path:
    link = tmp_path / "link.gguf"
    link.symlink_to(tmp_path / "gone.gguf")
    return link


def _shard_of_missing(tmp_path: Path) -> Path:
    return tmp_path / "no-such-dir" / "m.gguf"


# name → (a path, what gguf-py and ours raise for it)
UNOPENABLE: dict[str, tuple[Callable[[Path], Path], type[OSError]]] = {
    "missing": (_missing, FileNotFoundError),
    "dangling symlink": (_dangling, FileNotFoundError),
    "missing folder": (_shard_of_missing, FileNotFoundError),
    "a directory": (lambda tmp_path: tmp_path, IsADirectoryError),
}


@pytest.mark.parametrize("case", UNOPENABLE)
def test_a_file_that_cannot_be_opened_is_an_os_error(case: str, tmp_path: Path) -> None:
    """What gguf-py raises (``FileNotFoundError``, ``IsADirectoryError``, with its errno and
    file name), and aiogguf's ``LoadError``: ``except FileNotFoundError`` / ``except
    OSError`` written for gguf-py's reader catches ours."""
    make, kind = UNOPENABLE[case]
    path = make(tmp_path)
    with pytest.raises(kind) as theirs:
        gguf.GGUFReader(path)
    with pytest.raises(kind) as ours:
        GGUFReader(path)
    error = ours.value
    assert isinstance(error, LoadError)
    assert isinstance(error, CompatOSError)
    assert (error.errno, error.filename) == (theirs.value.errno, str(path))
    assert error.strerror == theirs.value.strerror == os.strerror(error.errno)
    assert str(error).startswith(f"{path}: ")  # aiogguf's message, naming the file
    with pytest.raises(OSError, match=re.escape(str(path))):
        GGUFReader(path)
    with pytest.raises(GGUFError):
        GGUFReader(path)


def test_only_the_compat_reader_raises_them(tmp_path: Path) -> None:
    """The rest of aiogguf raises its own errors, which are neither."""
    bad = _damaged(tmp_path, MALFORMED["bad magic"])
    with pytest.raises(GGUFFormatError) as format_error:
        aiogguf.inspect_sync(bad)
    assert not isinstance(format_error.value, ValueError)
    with pytest.raises(LoadError) as load_error:
        aiogguf.inspect_sync(tmp_path / "no-such.gguf")
    assert not isinstance(load_error.value, OSError)


def test_a_good_file_after_the_errors(tmp_path: Path) -> None:
    # The conversions leave nothing behind: a good file reads as before.
    path = _tiny(tmp_path / "good.gguf")
    compare(GGUFReader(path), gguf.GGUFReader(path))


@pytest.mark.parametrize("endian", ["little", "big"])
def test_arrays_of_every_type(endian: Literal["little", "big"], tmp_path: Path) -> None:
    """Arrays of each scalar type, of strings and of arrays, in both byte orders, cut into
    the same parts as gguf-py's (a vocabulary's arrays are cut by a path of their own)."""
    kv: dict[str, Any] = {"general.architecture": "llama"}
    for scalar in set(gguf.GGUFReader.gguf_scalar_to_np.values()):
        kv[f"array.{np.dtype(scalar).name}"] = [scalar(1), scalar(0), scalar(1)]
    kv["array.string"] = ["x", "", "yz"]
    kv["array.nested"] = ([[1, 2], [3]], gguf.GGUFValueType.ARRAY)
    path = write_gguf(
        tmp_path / "arrays.gguf", kv, [("w", np.ones((2, 32), np.float32))], endian=endian
    )
    ours = GGUFReader(path)
    compare(ours, gguf.GGUFReader(path))
    assert len([key for key in ours.fields if key.startswith("array.")]) == 13
    assert ours.fields["array.string"].contents() == ["x", "", "yz"]
    assert ours.fields["array.uint64"].contents() == [1, 0, 1]
    assert ours.fields["array.bool"].contents() == [True, False, True]
