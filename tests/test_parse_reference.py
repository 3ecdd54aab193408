"""``inspect --json`` on every llama.cpp-made reference file agrees with MANIFEST.json and
with ``gguf.GGUFReader``: every key, type and value; every tensor's name, type, shape,
offset and size. The first split of the split set stands for all three files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import REFERENCE_DIR
from gguf_oracle import json_metadata, reference_reader, run_inspect

from aiogguf._names import layer_of
from aiogguf._records import TensorClass
from aiogguf.cli import main
from aiogguf.stages.index import tensor_class

NAMES = sorted(p.name for p in REFERENCE_DIR.glob("*.gguf")) or ["<missing>"]
LATER_SPLITS = {n for n in NAMES if "-split-" in n and "-00001-of-" not in n}


def assert_agrees_with_reader(result: dict[str, Any], paths: list[Path]) -> None:
    """The JSON of ``inspect`` against gguf-py's reader of each file of the model."""
    assert [f["path"] for f in result["files"]] == [str(p) for p in paths]
    readers = [reference_reader(p) for p in paths]
    nested = any(
        e["type"] == "array" and e.get("item_type") == "array" for e in result["metadata"].values()
    )
    assert json_metadata(result["metadata"], flat=nested) == readers[0].metadata
    ours = {t["name"]: t for t in result["tensors"]}
    assert len(ours) == sum(len(r.tensors) for r in readers)
    for file_index, (reader, info) in enumerate(zip(readers, result["files"], strict=True)):
        assert info["data_offset"] == reader.data_offset
        assert info["alignment"] == reader.alignment
        assert info["byte_order"] == ("big" if reader.big_endian else "little")
        assert info["n_tensors"] == len(reader.tensors)
        for name, want in reader.tensors_json.items():
            got = ours[name]
            assert got["file"] == file_index
            assert {k: got[k] for k in want} == want, name


def _split_set(reference_dir: Path, name: str) -> list[Path]:
    if "-split-00001-of-" not in name:
        return [reference_dir / name]
    return sorted(reference_dir.glob(name.replace("-00001-of-", "-*-of-")))


@pytest.mark.parametrize("name", NAMES)
def test_reference_file_against_manifest_and_reader(
    name: str,
    reference_dir: Path,
    manifest: list[dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    if name in LATER_SPLITS:
        # Opening a later split is an error naming the first (tests/test_split.py).
        assert main(["inspect", "--json", str(reference_dir / name)]) == 2
        assert "-00001-of-00003.gguf" in capsys.readouterr().err
        return
    paths = _split_set(reference_dir, name)
    result = run_inspect(capsys, reference_dir / name)
    by_file = {entry["file"]: entry for entry in manifest}
    shards = [by_file[p.name] for p in paths]

    # files
    assert len(result["files"]) == len(shards)
    for info, shard in zip(result["files"], shards, strict=True):
        assert info["version"] == shard["gguf_version"]
        assert info["byte_order"] == "little"
        assert info["alignment"] == shard["alignment"]
        assert info["data_offset"] == shard["tensor_data_offset"]
        assert info["size"] == shard["size"]
        assert info["n_tensors"] == shard["tensor_count"]

    # metadata: the first file's, complete
    first = shards[0]
    assert len(result["metadata"]) == first["kv_count"]
    assert set(result["metadata"]) == set(first["kv"])
    for key, want in first["kv"].items():
        got = result["metadata"][key]
        if isinstance(want, dict):
            assert got["type"] == "array"
            assert got["item_type"] == want["array_of"].lower()
            assert len(got["value"]) == want["len"]
        else:
            assert got["value"] == want, key
            assert type(got["value"]) is type(want), key

    # tensors: every shard's, merged; offsets absolute in their own file
    ours = {t["name"]: t for t in result["tensors"]}
    assert len(ours) == len(result["tensors"]) == sum(s["tensor_count"] for s in shards)
    for file_index, shard in enumerate(shards):
        types: dict[str, int] = {}
        for want in shard["tensors"]:
            got = ours[want["name"]]
            assert got["file"] == file_index
            assert got["type"] == want["type"]
            assert got["shape"] == want["ne"]
            assert got["offset"] == shard["tensor_data_offset"] + want["offset"]
            assert got["nbytes"] == want["n_bytes"]
            types[want["type"]] = types.get(want["type"], 0) + 1
        assert types == shard["ggml_types"]
    totals = result["totals"]
    assert totals["n_tensors"] == len(ours)
    assert totals["nbytes"] == sum(t["nbytes"] for t in ours.values())
    n_elements = sum(int(np.prod(t["shape"])) for t in ours.values())
    assert totals["n_elements"] == n_elements
    assert totals["bpw"] == (totals["nbytes"] * 8 / n_elements if n_elements else 0.0)

    assert_agrees_with_reader(result, paths)


def test_layer_order_and_classes(reference_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = run_inspect(capsys, reference_dir / "tiny-llama-Q4_K_M.gguf")
    names = [t["name"] for t in result["tensors"]]
    assert names[:3] == ["output.weight", "output_norm.weight", "token_embd.weight"]
    layers = [t["layer"] for t in result["tensors"]]
    assert layers[:3] == [None, None, None]
    assert layers[3:] == sorted(layers[3:]) == [n for n in range(4) for _ in range(9)]
    classes = {t["name"]: t["class"] for t in result["tensors"]}
    assert classes["token_embd.weight"] == "input"
    assert classes["output.weight"] == classes["output_norm.weight"] == "output"
    assert {classes[n] for n in names[3:]} == {"repeating"}


@pytest.mark.parametrize(
    ("name", "layer", "cls"),
    [
        ("blk.0.attn_q.weight", 0, TensorClass.REPEATING),
        ("blk.17.ffn_down_exps.weight", 17, TensorClass.REPEATING),
        ("blk. 7.x", 7, TensorClass.REPEATING),  # sscanf skips the blank
        ("blk.+3.x", 3, TensorClass.REPEATING),
        ("blk.x.weight", None, TensorClass.REPEATING),
        ("enc.blk.1.attn_q.weight", None, TensorClass.REPEATING),
        ("posnet.2.conv1.weight", None, TensorClass.REPEATING),
        ("token_embd.weight", None, TensorClass.INPUT),
        ("position_embd.weight", None, TensorClass.INPUT),
        ("output.weight", None, TensorClass.OUTPUT),
        ("output_norm.bias", None, TensorClass.OUTPUT),
        ("cls.output.weight", None, TensorClass.OUTPUT),
        ("output", None, TensorClass.OUTPUT),
        ("rope_freqs.weight", None, TensorClass.REPEATING),
        ("token_embd_norm.weight", None, TensorClass.REPEATING),
        ("mystery.weight", None, None),
    ],
)
def test_layer_and_class_rules(name: str, layer: int | None, cls: TensorClass | None) -> None:
    assert layer_of(name) == layer
    assert tensor_class(name) is cls
