"""``aiogguf hash --format llama`` against an independent implementation: gguf-py's
``gguf_hash`` script (sha1, sha256, uuid), line by line, tensor by tensor, on every
reference file of llama.cpp and on synthetic ones; and reading the format back."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import xxhash
from conftest import reference_files
from gguf.scripts.gguf_hash import gguf_hash

from aiogguf.cli import main
from aiogguf.errors import IntegrityError, ManifestError, ManifestMismatchError
from aiogguf.integrity._hashing import hash_model_llama_sync, verify_model_sync
from aiogguf.integrity._llama_hash import GGUF_PY_SKIPPED, check_llama, format_llama, parse_llama
from aiogguf.testing.synth import write_synthetic_model


def gguf_py_lines(path: Path) -> list[str]:
    """What gguf-py's script prints for ``path``, named as aiogguf names it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        gguf_hash(gguf.GGUFReader(path), path.name, True, False)
    return out.getvalue().splitlines()


def ours(first: Path, tmp_path: Path) -> set[str]:
    output = tmp_path / "hash.txt"
    assert main(["hash", str(first), "--format", "llama", "-o", str(output)]) == 0
    return set(output.read_text().splitlines())


def assert_agrees(files: list[Path], tmp_path: Path) -> None:
    written = ours(files[0], tmp_path)
    theirs = [line for f in files for line in gguf_py_lines(f)]
    assert theirs  # at least the whole-model lines
    missing = [line for line in theirs if line not in written]
    assert missing == []
    # Every tensor gguf-py hashes has its sha1 and sha256 line from both.
    tensor_lines = [line for line in theirs if ":" in line.split()[-1]]
    assert len(tensor_lines) == 2 * sum(
        1 for f in files for t in gguf.GGUFReader(f).tensors if not t.name.endswith(GGUF_PY_SKIPPED)
    )


def _reference_sets() -> list[list[str]]:
    names = reference_files()
    singles = [[n] for n in names if "-of-" not in n]
    split = sorted(n for n in names if "-of-" in n)
    return singles + ([split] if split else [])


@pytest.mark.parametrize("names", _reference_sets(), ids=lambda names: names[0])
def test_agrees_with_gguf_py_on_every_reference_file(
    reference_dir: Path, names: list[str], tmp_path: Path
) -> None:
    assert_agrees([reference_dir / n for n in names], tmp_path)


@pytest.mark.parametrize(
    ("types", "split_count", "big_endian"),
    [("mixed", 1, False), ("all-types", 1, False), ("q8_0", 3, False), ("float", 1, True)],
)
def test_agrees_with_gguf_py_on_synthetic_models(
    types: str, split_count: int, big_endian: bool, tmp_path: Path
) -> None:
    path = tmp_path / "m.gguf"
    write_synthetic_model(
        path,
        size_bytes="3MiB",
        seed=4,
        n_layer=5 if types == "all-types" else 2,
        types=types,
        split_count=split_count,
        big_endian=big_endian,
        include_q2_0=False,  # gguf 0.19's reader refuses that type id
    )
    files = sorted(tmp_path.glob("m*.gguf"))
    assert len(files) == split_count
    assert_agrees(files, tmp_path)


@pytest.fixture
def with_skipped(tmp_path: Path) -> Path:
    """A file holding a tensor that gguf-py leaves out (and llama.cpp's tool does not)."""
    path = tmp_path / "skip.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    rng = np.random.default_rng(3)
    writer.add_tensor("token_embd.weight", rng.standard_normal((4, 32), dtype=np.float32))
    writer.add_tensor("blk.0.attn.rotary_emb.inv_freq", rng.standard_normal(16, dtype=np.float32))
    writer.add_tensor("output.weight", rng.standard_normal((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_tensors_gguf_py_skips_are_skipped_as_it_does(
    with_skipped: Path, tmp_path: Path
) -> None:
    written = ours(with_skipped, tmp_path)
    assert not any("inv_freq" in line for line in written)
    assert_agrees([with_skipped], tmp_path)


def test_a_manifest_of_llama_cpps_own_tool_is_accepted(with_skipped: Path) -> None:
    """llama.cpp's tool hashes the skipped tensor too, into its whole-model line."""
    data = with_skipped.read_bytes()
    reader = gguf.GGUFReader(with_skipped)
    start = reader.tensors[0].data_offset
    end = reader.tensors[-1].data_offset + reader.tensors[-1].n_bytes
    model = xxhash.xxh64()
    lines = ["manifest  x.txt  xxh64"]
    for t in reader.tensors:
        tensor = data[t.data_offset : t.data_offset + t.n_bytes]
        model.update(tensor)
        lines.append(f"xxh64     {xxhash.xxh64_hexdigest(tensor)}  /models/skip.gguf:{t.name}")
    assert start < end
    lines.append(f"xxh64     {model.hexdigest()}  /models/skip.gguf  -  Ok")
    report = verify_model_sync(with_skipped, parse_llama("\n".join(lines)))
    assert report.files == 1


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama") / "m.gguf"
    write_synthetic_model(path, size_bytes="2MiB", seed=8, n_layer=2)
    return path


def test_reading_back_what_was_written(model: Path) -> None:
    digests = hash_model_llama_sync(model)
    manifest = parse_llama(format_llama(digests))
    assert check_llama(manifest, digests) == []
    assert manifest.algorithms == {"xxh64", "xxh3", "sha1", "sha256", "uuid"}


def test_a_changed_tensor_is_named(model: Path, tmp_path: Path) -> None:
    text = format_llama(hash_model_llama_sync(model))
    damaged = tmp_path / "m.gguf"
    data = bytearray(model.read_bytes())
    victim = gguf.GGUFReader(model).tensors[3]
    data[victim.data_offset + 1] ^= 4
    damaged.write_bytes(data)
    with pytest.raises(IntegrityError) as info:
        verify_model_sync(damaged, parse_llama(text))
    names = {f.name for f in info.value.failures}
    assert names == {victim.name, "(all of m.gguf)"}
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", "no xxh64"),
        ("hello world\nmanifest a b\n", "no xxh64"),
        ("xxh64  123  m.gguf:a\n", "line 1"),
        ("sha1  " + "g" * 40 + "  m.gguf\n", "expected a sha1 digest"),
        ("uuid  not-a-uuid  m.gguf\n", "expected a uuid digest"),
    ],
)
def test_a_malformed_llama_manifest_is_refused(text: str, words: str) -> None:
    with pytest.raises(ManifestError, match=words):
        parse_llama(text, "h.txt")


def test_a_llama_manifest_of_another_model_is_refused(model: Path, tmp_path: Path) -> None:
    other = tmp_path / "o.gguf"
    write_synthetic_model(other, size_bytes="2MiB", seed=8, n_layer=3)
    text = format_llama(hash_model_llama_sync(other))
    read: list[int] = []
    with pytest.raises(ManifestMismatchError, match="not a manifest of this model"):
        verify_model_sync(model, parse_llama(text), progress=lambda d, t: read.append(d))
    assert read == []  # refused before any data was read
    one_tensor = "\n".join(line for line in text.splitlines() if "token_embd" in line)
    with pytest.raises(ManifestMismatchError, match="no line for tensor"):
        verify_model_sync(model, parse_llama(one_tensor))


def test_the_file_part_of_a_key_is_ignored(model: Path) -> None:
    text = format_llama(hash_model_llama_sync(model))
    moved = text.replace("m.gguf", os.path.join("/elsewhere:x", "renamed.gguf"))
    assert verify_model_sync(model, parse_llama(moved)).files == 1
