"""Split models (format §2): the first split stands for the set; every way a set can
be incomplete, out of order or mixed is a ``SplitError`` that names the right file."""

from __future__ import annotations

import dataclasses
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import anyio
import gguf
import numpy as np
import pytest

import aiogguf.stages.parse as parse_stage
from aiogguf._core.assemble import open_index
from aiogguf._records import ParsedFile
from aiogguf.errors import GGUFError, SplitError
from aiogguf.stages.index import build_index
from aiogguf.stages.parse import parse_header, parse_model, split_paths

SPLIT = "tiny-llama-Q4_K_M-split-{:05d}-of-00003.gguf"


@pytest.fixture
def split_set(reference_dir: Path, tmp_path: Path) -> list[Path]:
    """A private copy of the reference split set, free to tamper with."""
    paths = []
    for i in range(1, 4):
        target = tmp_path / SPLIT.format(i)
        shutil.copyfile(reference_dir / SPLIT.format(i), target)
        target.chmod(0o644)
        paths.append(target)
    return paths


def write_split_set(directory: Path, n_tensors: int, per_split: int, **kwargs: bool) -> list[Path]:
    """A split set written by gguf-py: ``n_tensors`` small F32 tensors, ``per_split`` each."""
    writer = gguf.GGUFWriter(directory / "m.gguf", "llama", split_max_tensors=per_split, **kwargs)
    writer.add_block_count(n_tensors)
    for i in range(n_tensors):
        writer.add_tensor(f"blk.{i}.ffn_up.weight", np.full((2, 8), i, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(directory.glob("m-*-of-*.gguf"))


def patch_int(path: Path, key: str, fmt: str, value: int) -> None:
    """Overwrite the value of metadata ``key`` in place (same type, same width)."""
    data = bytearray(path.read_bytes())
    entry = parse_header(bytes(data), path, len(data)).metadata[key]
    at = entry.offset + 8 + len(key.encode()) + 4  # key length, key, value type
    struct.pack_into("<" + fmt, data, at, value)
    path.write_bytes(bytes(data))


@pytest.mark.asyncio
async def test_first_split_merges_every_file(split_set: list[Path]) -> None:
    files = await parse_model(split_set[0])
    assert [f.path for f in files] == [str(p) for p in split_set]
    index = build_index(files)
    assert index.totals.n_tensors == 39 == sum(len(f.tensors) for f in files)
    for file_index, parsed in enumerate(files):
        for info in parsed.tensors:
            entry = index[info.name]
            assert entry.file_index == file_index
            assert entry.offset == parsed.data_offset + info.offset
    assert index.n_layer == 4
    assert index.architecture == "llama"


def test_split_paths() -> None:
    assert split_paths("/d/x-00002-of-00003.gguf", 1, 3) == [
        "/d/x-00001-of-00003.gguf",
        "/d/x-00002-of-00003.gguf",
        "/d/x-00003-of-00003.gguf",
    ]
    with pytest.raises(SplitError, match="invalid split file name"):
        split_paths("/d/x-00001-of-00003.gguf", 1, 3)
    with pytest.raises(SplitError, match="invalid split file name"):
        split_paths("/d/-00001-of-00003.gguf", 0, 3)


@pytest.mark.asyncio
@pytest.mark.parametrize("later", [1, 2])
async def test_later_split_names_the_first(split_set: list[Path], later: int) -> None:
    with pytest.raises(SplitError) as info:
        await open_index(split_set[later])
    assert str(split_set[0]) in str(info.value)
    assert f"split {later + 1} of 3" in str(info.value)


@pytest.mark.asyncio
@pytest.mark.parametrize("missing", [1, 2])
async def test_missing_split_is_named(split_set: list[Path], missing: int) -> None:
    split_set[missing].unlink()
    with pytest.raises(SplitError, match="is missing") as info:
        await open_index(split_set[0])
    assert info.value.path == str(split_set[missing])
    assert str(split_set[missing]) in str(info.value)


@pytest.mark.asyncio
async def test_tensor_count_mismatch(split_set: list[Path]) -> None:
    for path in split_set:  # every shard agrees, but the count is wrong
        patch_int(path, "split.tensors.count", "i", 40)
    with pytest.raises(SplitError, match=r"split.tensors.count is 40 but the 3 splits hold 39"):
        await open_index(split_set[0])


@pytest.mark.asyncio
async def test_split_tensor_count_disagreement(split_set: list[Path]) -> None:
    patch_int(split_set[2], "split.tensors.count", "i", 38)
    with pytest.raises(SplitError, match="another split set") as info:
        await open_index(split_set[0])
    assert info.value.path == str(split_set[2])


@pytest.mark.asyncio
async def test_shard_from_another_split_set(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ours = write_split_set(tmp_path / "a", n_tensors=6, per_split=2)
    other = write_split_set(tmp_path / "b", n_tensors=9, per_split=3)
    assert len(ours) == len(other) == 3
    assert (await open_index(ours[0])).totals.n_tensors == 6
    shutil.copyfile(other[1], ours[1])
    with pytest.raises(SplitError, match="another split set") as info:
        await open_index(ours[0])
    assert info.value.path == str(ours[1])


@pytest.mark.asyncio
async def test_split_out_of_place(split_set: list[Path]) -> None:
    shutil.copyfile(split_set[2], split_set[1])
    with pytest.raises(SplitError, match=r"split.no is 2 but this file is split 2 \(split.no 1\)"):
        await open_index(split_set[0])


@pytest.mark.asyncio
async def test_split_count_disagreement(split_set: list[Path]) -> None:
    patch_int(split_set[1], "split.count", "H", 4)
    with pytest.raises(SplitError, match=r"split.count is 4 .* another split set"):
        await open_index(split_set[0])


@pytest.mark.asyncio
async def test_duplicate_tensor_across_splits(split_set: list[Path]) -> None:
    files = list(await parse_model(split_set[0]))
    taken = files[0].tensors[0].name
    renamed = dataclasses.replace(files[2].tensors[0], name=taken)
    files[2] = dataclasses.replace(files[2], tensors=(renamed, *files[2].tensors[1:]))
    with pytest.raises(SplitError, match=f"tensor '{taken}' is duplicated") as info:
        build_index(files)
    assert str(split_set[0]) in str(info.value)
    assert str(split_set[2]) in str(info.value)


@pytest.mark.asyncio
async def test_first_split_without_tensors(tmp_path: Path) -> None:
    paths = write_split_set(tmp_path, n_tensors=4, per_split=2, small_first_shard=True)
    files = await parse_model(paths[0])
    assert [len(f.tensors) for f in files] == [0, 2, 2]
    index = build_index(files)
    assert [t.file_index for t in index.tensors] == [1, 1, 2, 2]
    assert [t.layer for t in index.tensors] == [0, 1, 2, 3]


@pytest.mark.asyncio
async def test_first_split_renamed(split_set: list[Path]) -> None:
    renamed = split_set[0].with_name("model.gguf")
    split_set[0].rename(renamed)
    with pytest.raises(SplitError, match="invalid split file name"):
        await open_index(renamed)


@pytest.mark.asyncio
async def test_build_index_needs_the_whole_set(split_set: list[Path]) -> None:
    files = await parse_model(split_set[0])
    with pytest.raises(SplitError, match=r"split.count is 3 but 2 files were given"):
        build_index(files[:2])
    with pytest.raises(GGUFError, match=r"split.no is 2 but this file is split 2 \(split.no 1\)"):
        build_index([files[0], files[2], files[1]])


@pytest.mark.asyncio
async def test_splits_are_parsed_concurrently(
    split_set: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each later split waits until the other has started: only concurrency gets through."""
    real_parse_file = parse_stage.parse_file
    started: list[str] = []
    both_started = anyio.Event()

    async def gated(path: str | os.PathLike[str], **kwargs: Any) -> ParsedFile:
        if "-00001-of-" not in os.fspath(path):
            started.append(os.fspath(path))
            if len(started) == 2:
                both_started.set()
            with anyio.fail_after(10):
                await both_started.wait()
        return await real_parse_file(path, **kwargs)

    monkeypatch.setattr(parse_stage, "parse_file", gated)
    files = await parse_model(split_set[0])
    assert sorted(started) == [str(p) for p in split_set[1:]]
    assert [len(f.tensors) for f in files] == [13, 13, 13]
