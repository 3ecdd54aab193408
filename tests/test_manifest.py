"""The manifest's JSON: a round trip, and every kind of hostile manifest refused with a
``ManifestError`` naming the field (never another exception)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiogguf.errors import LoadError, ManifestError
from aiogguf.integrity._hashing import hash_model_sync
from aiogguf.integrity._manifest import (
    BLOCK_BYTES,
    MAX_MANIFEST_BYTES,
    Manifest,
    block_digest,
    manifest_json,
    parse_manifest,
    read_manifest_text,
)
from aiogguf.testing.synth import write_synthetic_model

SMALL_BLOCK = 256 << 10


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("manifest") / "m.gguf"
    write_synthetic_model(path, size_bytes="2MiB", seed=5, n_layer=2)
    return path


@pytest.fixture(scope="module")
def manifest(model: Path) -> Manifest:
    return hash_model_sync(model, block_bytes=SMALL_BLOCK)


def test_the_manifest_holds_what_the_file_is(model: Path, manifest: Manifest) -> None:
    data = model.read_bytes()
    (f,) = manifest.files
    assert f.size == len(data)
    assert f.sha256 == hashlib.sha256(data).digest()
    assert f.header_xxh3_128 == xxhash.xxh3_128_digest(data[: f.header_bytes])
    assert len(f.blocks) == -(-(f.data_end - f.header_bytes) // SMALL_BLOCK) > 4
    for k, digest in enumerate(f.blocks):
        start = f.header_bytes + k * SMALL_BLOCK
        end = min(start + SMALL_BLOCK, f.data_end)
        assert digest == xxhash.xxh3_128_digest(data[start:end], k)
    for t in manifest.tensors:
        assert t.xxh3_128 == xxhash.xxh3_128_digest(data[t.offset : t.end])
    assert f.data_end == max(t.end for t in manifest.tensors)


def test_the_default_block_is_16_mib(model: Path) -> None:
    assert hash_model_sync(model).block_bytes == BLOCK_BYTES == 16 << 20


def test_round_trip(manifest: Manifest) -> None:
    assert parse_manifest(manifest_json(manifest)) == manifest


def test_a_moved_block_does_not_match() -> None:
    data = b"x" * 1000
    assert block_digest(data, 3) != block_digest(data, 4)


def _edit(manifest: Manifest, change: Any) -> str:
    data = json.loads(manifest_json(manifest))
    change(data)
    return json.dumps(data)


def _set(path: list[Any], value: Any) -> Any:
    def change(data: Any) -> None:
        for key in path[:-1]:
            data = data[key]
        data[path[-1]] = value

    return change


HOSTILE: dict[str, tuple[Any, str]] = {
    # name: (change to the decoded JSON, words the error must hold)
    "another format": (_set(["format"], "safetensors"), "format"),
    "a newer version": (_set(["version"], 2), "version 2"),
    "a boolean version": (_set(["version"], True), "expected an integer"),
    "odd blocks": (_set(["block_bytes"], 3 << 20), "power of two"),
    "tiny blocks": (_set(["block_bytes"], 4096), "block_bytes"),
    "no files": (_set(["files"], []), "at least one file"),
    "files not a list": (_set(["files"], {"a": 1}), "expected a list"),
    "unknown key": (_set(["extra"], 1), "unknown field 'extra'"),
    "missing key": (lambda d: d["files"][0].pop("sha256"), "missing sha256"),
    "negative size": (_set(["files", 0, "size"], -1), "files[0].size"),
    "huge size": (_set(["files", 0, "size"], 1 << 70), "files[0].size"),
    "header past the end": (_set(["files", 0, "header_bytes"], 1 << 40), "header_bytes"),
    "a block too few": (lambda d: d["files"][0]["blocks"].pop(), "blocks"),
    "upper-case hex": (lambda d: d["files"][0].update(sha256="AB" * 32), "hex digits"),
    "short hex": (_set(["files", 0, "blocks", 0], "abc"), "files[0].blocks[0]"),
    "a name with NUL": (_set(["files", 0, "name"], "a\0b"), "NUL"),
    "tensor in no file": (_set(["tensors", 0, "file"], 7), "tensors[0].file"),
    "tensor past the data": (_set(["tensors", 0, "nbytes"], 1 << 40), "tensors[0].nbytes"),
    "tensor in the header": (_set(["tensors", 0, "offset"], 0), "tensors[0].offset"),
    "tensor name too long": (_set(["tensors", 0, "name"], "é" * 40), "63 bytes"),
    "a tensor twice": (lambda d: d["tensors"].append(d["tensors"][0]), "listed twice"),
    "an edited digest": (_set(["files", 0, "blocks", 1], "0" * 32), "set_id"),
    "an edited tensor": (_set(["tensors", 1, "xxh3_128"], "1" * 32), "set_id"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_manifest_is_refused_naming_the_field(manifest: Manifest, name: str) -> None:
    change, words = HOSTILE[name]
    with pytest.raises(ManifestError) as info:
        parse_manifest(_edit(manifest, change), "m.json")
    message = str(info.value)
    assert message.startswith("m.json: ")
    assert words in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", "not JSON"),
        ("[" * 100_000 + "]" * 100_000, "expected an object, got a list"),
        ('{"files": ' + "[" * 100_000, r"files\[0\]: expected an object, got a list"),
        ('{"version": NaN}', "not JSON"),
        ("[1, 2]", "expected an object"),
        ("null", "expected an object"),
        ('{"a": 1e999}', "unknown field 'a'"),
        ('{"version": 1e999}', "missing block_bytes"),
        ('{"version": 1, "version": 1}', "version: given twice"),
        ('{"version": 1,}', "not JSON: expected a field name"),
        ('{"files": [{"sizes": 1}]} x', r"files\[0\]: unknown field 'sizes'"),
    ],
)
def test_text_that_is_no_manifest_is_refused(text: str, words: str) -> None:
    with pytest.raises(ManifestError, match=words):
        parse_manifest(text)


def test_an_oversized_manifest_is_refused_before_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    with path.open("wb") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)
    with pytest.raises(ManifestError, match="at most"):
        read_manifest_text(path)


def test_a_manifest_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_bytes(b'{"format": "\xff"}')
    with pytest.raises(ManifestError, match="not UTF-8"):
        read_manifest_text(path)


def test_a_missing_manifest_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(LoadError, match="cannot open"):
        read_manifest_text(tmp_path / "none.json")


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_damage_is_refused_or_harmless(manifest: Manifest, data: st.DataObject) -> None:
    """A manifest with bytes changed anywhere parses to the same manifest (a change in
    spacing or a file's name) or is refused with ``ManifestError``; nothing else
    escapes."""
    text = bytearray(manifest_json(manifest).encode())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(text) - 1))
        text[at] = data.draw(st.integers(0, 255))
    try:
        parsed = parse_manifest(text.decode(errors="replace"))
    except ManifestError:
        return
    # File names are for messages only (never matched), so the set id leaves them out.
    renamed = tuple(
        replace(f, name=g.name) for f, g in zip(manifest.files, parsed.files, strict=True)
    )
    assert parsed == replace(manifest, files=renamed)
