"""The block checker, called directly as the read path will call it: block-aligned
pieces of landed bytes, each checked on its own. Planted corruptions (a bit flip in a
quantized block, a zero-filled MiB, a truncated-and-padded shard, a shard of another
set with the same shapes, two blocks swapped) are each found and named: the tensor, the
file, the block and its offset. A clean model passes; a manifest of another model is
refused in one line."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiogguf._dry_run import inspect_sync
from aiogguf._records import WeightIndex
from aiogguf.errors import IntegrityError, ManifestMismatchError
from aiogguf.integrity._checker import IntegrityChecker, Mismatch, match_manifest
from aiogguf.integrity._hashing import hash_model_sync, verify_model_sync
from aiogguf.integrity._manifest import Manifest
from aiogguf.testing.synth import write_synthetic_model

BLOCK = 256 << 10
MiB = 1 << 20


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("integrity") / "m.gguf"
    write_synthetic_model(path, size_bytes="6MiB", seed=11, n_layer=3)
    return path


@pytest.fixture(scope="module")
def clean_manifest(clean: Path) -> Manifest:
    return hash_model_sync(clean, block_bytes=BLOCK)


@pytest.fixture
def model(clean: Path, tmp_path: Path) -> Path:
    """A copy of the clean model, to damage."""
    path = tmp_path / "m.gguf"
    shutil.copyfile(clean, path)
    return path


def pieces(manifest: Manifest, file_index: int, blocks_per_piece: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of the block-aligned pieces a reader would land."""
    f = manifest.files[file_index]
    step = manifest.block_bytes * blocks_per_piece
    for at in range(f.header_bytes, f.data_end, step):
        yield at, min(step, f.data_end - at)


def check_files(
    checker: IntegrityChecker, paths: list[Path], blocks_per_piece: int = 2
) -> list[Mismatch]:
    found: list[Mismatch] = []
    for i, path in enumerate(paths):
        data = path.read_bytes()
        for at, n in pieces(checker.manifest, i, blocks_per_piece):
            found += checker.check_piece(i, at, memoryview(data)[at : at + n])
    return found


def quantized(index: WeightIndex) -> str:
    return next(t.name for t in index.tensors if t.type.name in ("Q4_K", "Q6_K", "Q8_0"))


def test_a_clean_model_passes(clean: Path, clean_manifest: Manifest) -> None:
    checker = IntegrityChecker(clean_manifest)
    for blocks_per_piece in (1, 3, 1000):
        assert check_files(checker, [clean], blocks_per_piece) == []


def test_a_bit_flip_in_a_quantized_block_is_named(model: Path, clean_manifest: Manifest) -> None:
    index = inspect_sync(model)
    name = quantized(index)
    entry = index[name]
    at = entry.offset + entry.nbytes // 2 + 5
    data = bytearray(model.read_bytes())
    data[at] ^= 0x10
    model.write_bytes(data)
    checker = IntegrityChecker(clean_manifest, index, file_names=["m.gguf"])
    (m,) = check_files(checker, [model], blocks_per_piece=1000)
    f = clean_manifest.files[0]
    block = (at - f.header_bytes) // BLOCK
    assert (m.file_name, m.block, m.offset) == ("m.gguf", block, f.header_bytes + block * BLOCK)
    assert m.tensors == (name,)  # only the tensor that holds the flipped bit
    (failure,) = checker.failures([m])
    assert (failure.name, failure.type_name) == (name, entry.type.name)
    assert f"m.gguf block {block} at offset {m.offset}" in failure.problem


def test_a_zero_filled_mib_is_found_in_every_block_it_touches(
    model: Path, clean_manifest: Manifest
) -> None:
    index = inspect_sync(model)
    f = clean_manifest.files[0]
    start = f.header_bytes + 3 * BLOCK + 1000
    data = bytearray(model.read_bytes())
    data[start : start + MiB] = bytes(MiB)
    model.write_bytes(data)
    found = check_files(IntegrityChecker(clean_manifest, index), [model], blocks_per_piece=1000)
    first, last = (start - f.header_bytes) // BLOCK, (start + MiB - 1 - f.header_bytes) // BLOCK
    assert [m.block for m in found] == list(range(first, last + 1))
    touched = {t.name for t in index.tensors if t.offset < start + MiB and t.end > start}
    assert {name for m in found for name in m.tensors} == touched


def test_a_swapped_pair_of_blocks_is_found(model: Path, clean_manifest: Manifest) -> None:
    f = clean_manifest.files[0]
    a, b = f.header_bytes + 2 * BLOCK, f.header_bytes + 5 * BLOCK
    data = bytearray(model.read_bytes())
    data[a : a + BLOCK], data[b : b + BLOCK] = data[b : b + BLOCK], data[a : a + BLOCK]
    model.write_bytes(data)
    found = check_files(IntegrityChecker(clean_manifest), [model], blocks_per_piece=1)
    assert [(m.block, m.offset) for m in found] == [(2, a), (5, b)]
    assert all(m.suspects for m in found)


def test_each_piece_is_checked_on_its_own(model: Path, clean_manifest: Manifest) -> None:
    """Pieces in any order, each on its own: what the reader threads will do."""
    f = clean_manifest.files[0]
    at = f.header_bytes + 4 * BLOCK + 7
    data = bytearray(model.read_bytes())
    data[at] ^= 1
    checker = IntegrityChecker(clean_manifest)
    found = [
        m
        for start, n in reversed(list(pieces(clean_manifest, 0, 1)))
        for m in checker.check_piece(0, start, memoryview(data)[start : start + n])
    ]
    assert [m.block for m in found] == [4]


def test_a_piece_that_is_not_whole_blocks_is_a_caller_bug(clean_manifest: Manifest) -> None:
    f = clean_manifest.files[0]
    checker = IntegrityChecker(clean_manifest)
    for start, n in ((f.header_bytes + 1, BLOCK), (f.header_bytes, BLOCK - 1), (0, BLOCK)):
        with pytest.raises(ValueError, match="not whole blocks"):
            checker.check_piece(0, start, bytes(n))
    with pytest.raises(ValueError, match="not whole blocks"):
        checker.check_piece(0, f.data_end - 10, bytes(20))  # past the data's end


def test_a_whole_tensor_can_be_checked_alone(clean: Path, clean_manifest: Manifest) -> None:
    data = clean.read_bytes()
    checker = IntegrityChecker(clean_manifest)
    t = clean_manifest.tensors[2]
    assert checker.check_tensor(t.name, data[t.offset : t.end])
    assert not checker.check_tensor(t.name, data[t.offset + 1 : t.end + 1])


@pytest.fixture(scope="module")
def split_sets(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], list[Path]]:
    """Two split sets of the same shapes and different bytes."""
    root = tmp_path_factory.mktemp("sets")
    made = []
    for seed, folder in ((21, "a"), (22, "b")):
        (root / folder).mkdir()
        write_synthetic_model(
            root / folder / "s.gguf", size_bytes="4MiB", seed=seed, n_layer=3, split_count=3
        )
        made.append(sorted((root / folder).glob("s-*.gguf")))
    return made[0], made[1]


def _copy_set(paths: list[Path], folder: Path) -> list[Path]:
    folder.mkdir()
    return [Path(shutil.copyfile(p, folder / p.name)) for p in paths]


def test_a_truncated_and_padded_shard_is_found(
    split_sets: tuple[list[Path], list[Path]], tmp_path: Path
) -> None:
    ours = _copy_set(split_sets[0], tmp_path / "m")
    manifest = hash_model_sync(ours[0], block_bytes=BLOCK)
    index = inspect_sync(ours[0])
    shard = ours[1]
    size = shard.stat().st_size
    cut = size // 2
    with shard.open("r+b") as f:
        f.truncate(cut)
        f.truncate(size)  # zeros, as a preallocated download leaves them
    checker = IntegrityChecker(manifest, index)
    found = check_files(checker, ours)
    assert found
    assert {m.file_index for m in found} == {1}
    lost = {t.name for t in index.tensors if t.file_index == 1 and t.end > cut}
    # Pieces of two blocks: the tensors they hold whole are checked on the spot...
    assert {n for m in found for n in m.tensors} <= lost <= {n for m in found for n in m.suspects}
    # ... the others once they have landed whole.
    data = shard.read_bytes()
    settled = checker.settle(found, lambda name: data[index[name].offset : index[name].end])
    assert {n for m in settled for n in m.suspects} == lost
    assert all(not m.unchecked for m in settled)
    with pytest.raises(IntegrityError) as info:
        verify_model_sync(ours[0], manifest)
    assert {f.name for f in info.value.failures} == lost
    assert "\n" not in str(info.value)
    assert shard.name in str(info.value)


def test_a_shard_of_another_set_with_the_same_shapes_is_found(
    split_sets: tuple[list[Path], list[Path]], tmp_path: Path
) -> None:
    ours = _copy_set(split_sets[0], tmp_path / "m")
    manifest = hash_model_sync(ours[0], block_bytes=BLOCK)
    foreign = split_sets[1][2]
    shutil.copyfile(foreign, ours[2])
    index = inspect_sync(ours[0])
    match_manifest(manifest, index)  # same shapes: the manifest still fits the model
    found = check_files(IntegrityChecker(manifest, index), ours)
    assert {m.file_index for m in found} == {2}
    assert len(found) == len(manifest.files[2].blocks)  # every block of it differs
    shard_tensors = {t.name for t in index.tensors if t.file_index == 2}
    assert {n for m in found for n in m.suspects} == shard_tensors


def test_a_manifest_of_another_model_is_refused_in_one_line(
    clean_manifest: Manifest, split_sets: tuple[list[Path], list[Path]]
) -> None:
    with pytest.raises(ManifestMismatchError) as info:
        match_manifest(clean_manifest, inspect_sync(split_sets[0][0]), "m.json")
    message = str(info.value)
    assert message == "m.json: not a manifest of this model: it covers 1 file, the model has 3"


def test_a_manifest_with_other_tensor_ranges_is_refused(clean: Path, tmp_path: Path) -> None:
    other = tmp_path / "o.gguf"
    write_synthetic_model(other, size_bytes="6MiB", seed=11, n_layer=4)
    with pytest.raises(ManifestMismatchError, match="not a manifest of this model"):
        match_manifest(hash_model_sync(other, block_bytes=BLOCK), inspect_sync(clean))


def test_verify_names_every_bad_tensor_at_once(model: Path, clean_manifest: Manifest) -> None:
    index = inspect_sync(model)
    bad = [index.tensors[1], index.tensors[-1]]
    data = bytearray(model.read_bytes())
    for t in bad:
        data[t.offset + 3] ^= 0xFF
    model.write_bytes(data)
    with pytest.raises(IntegrityError) as info:
        verify_model_sync(model, clean_manifest)
    assert {f.name for f in info.value.failures} == {t.name for t in bad}
    assert verify_model_sync(model, hash_model_sync(model, block_bytes=BLOCK)).files == 1


def test_a_header_is_checked_against_its_fingerprint(clean: Path, clean_manifest: Manifest) -> None:
    f = clean_manifest.files[0]
    header = bytearray(clean.read_bytes()[: f.header_bytes])
    checker = IntegrityChecker(clean_manifest)
    assert checker.check_header(0, header)
    header[100] ^= 1
    assert not checker.check_header(0, header)
    assert not checker.check_header(0, header[:-1])


def test_another_models_manifest_is_refused_before_any_data_is_read(
    clean: Path, split_sets: tuple[list[Path], list[Path]]
) -> None:
    read: list[int] = []
    other = hash_model_sync(split_sets[0][0], block_bytes=BLOCK)
    with pytest.raises(ManifestMismatchError):
        verify_model_sync(clean, other, progress=lambda done, total: read.append(done))
    assert read == []


def test_a_renamed_model_still_checks(
    clean: Path, clean_manifest: Manifest, tmp_path: Path
) -> None:
    renamed = tmp_path / "renamed.gguf"
    shutil.copyfile(clean, renamed)
    assert verify_model_sync(renamed, clean_manifest).files == 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, Manifest, WeightIndex]:
    path = tmp_path_factory.mktemp("tiny") / "t.gguf"
    write_synthetic_model(path, size_bytes="1MiB", seed=3, n_layer=1)
    manifest = hash_model_sync(path, block_bytes=64 << 10)
    return path.read_bytes(), manifest, inspect_sync(path)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_changed_bytes_are_found_in_their_blocks_and_tensors(
    tiny: tuple[bytes, Manifest, WeightIndex], data: st.DataObject
) -> None:
    clean, manifest, index = tiny
    f = manifest.files[0]
    at = data.draw(
        st.lists(st.integers(f.header_bytes, f.data_end - 1), min_size=1, max_size=5, unique=True)
    )
    damaged = bytearray(clean)
    for offset in at:
        damaged[offset] ^= data.draw(st.integers(1, 255))
    whole = memoryview(damaged)[f.header_bytes : f.data_end]
    found = IntegrityChecker(manifest, index).check_piece(0, f.header_bytes, whole)
    assert {m.block for m in found} == {(o - f.header_bytes) // manifest.block_bytes for o in at}
    hit = {t.name for t in index.tensors for o in at if t.offset <= o < t.end}
    assert {n for m in found for n in m.tensors} == hit
    assert all(not m.unchecked for m in found)


def test_bytes_after_the_last_tensor_are_checked_by_verify(
    model: Path, clean_manifest: Manifest
) -> None:
    f = clean_manifest.files[0]
    assert f.size > f.data_end  # the writer pads after the last tensor
    data = bytearray(model.read_bytes())
    data[-1] ^= 1
    model.write_bytes(data)
    with pytest.raises(IntegrityError) as info:
        verify_model_sync(model, clean_manifest)
    (failure,) = info.value.failures
    assert failure.name == "(between tensors)"
    assert f"block {len(f.blocks)} at offset {f.data_end}" in failure.problem


def test_whole_blocks_are_the_block_aligned_part_of_a_range(
    clean: Path, clean_manifest: Manifest
) -> None:
    f = clean_manifest.files[0]
    h, B, end = f.header_bytes, BLOCK, f.data_end
    checker = IntegrityChecker(clean_manifest)
    assert checker.whole_blocks(0, 0, f.size) == (h, end)  # the whole data
    assert checker.whole_blocks(0, h + 1, h + 3 * B + 5) == (h + B, h + 3 * B)
    assert checker.whole_blocks(0, h + B, h + 2 * B) == (h + B, h + 2 * B)
    assert checker.whole_blocks(0, h + 1, h + B + 1) == (h + B, h + B)  # none whole
    last = h + (len(f.blocks) - 1) * B
    assert checker.whole_blocks(0, last - 100, f.size) == (last, end)  # a short last block
    data = clean.read_bytes()
    for start, stop in ((h + 10, h + 5 * B), (last - 1, f.size), (0, h + 2 * B - 1)):
        lo, hi = checker.whole_blocks(0, start, stop)
        assert checker.check_piece(0, lo, data[lo:hi]) == []  # a piece it accepts
