"""Files written by ``gguf.GGUFWriter``: ``inspect --json`` agrees with ``gguf.GGUFReader``
and with what was written, for every value type, nested and empty arrays, a 150k-entry
vocabulary, zero tensors, both byte orders."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf_oracle import json_metadata, norm, reader_metadata, run_inspect

from aiogguf._records import GGUFArray, ParsedFile, ValueType
from aiogguf.stages.parse import (
    FIRST_READ_BYTES,
    NeedMoreBytes,
    _HeaderParser,
    parse_file,
    parse_header,
)

VT = gguf.GGUFValueType
QT = gguf.GGMLQuantizationType
LITTLE, BIG = gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG


class Writer(gguf.GGUFWriter):  # type: ignore[misc]
    """GGUFWriter that can also write empty arrays (the stock one refuses them)."""

    def _pack_val(self, val: Any, vtype: VT, add_vtype: bool, sub_type: VT | None = None) -> bytes:
        if vtype == VT.ARRAY and len(val) == 0:
            head = self._pack("I", vtype) if add_vtype else b""
            item = sub_type if sub_type is not None else VT.UINT8
            return bytes(head + self._pack("I", item) + self._pack("Q", 0))
        packed: bytes = super()._pack_val(val, vtype, add_vtype, sub_type)
        return packed


# key → (value type, value, array item type); every value type and array item type.
SCALARS: list[tuple[str, VT, Any]] = [
    ("t.uint8", VT.UINT8, 255),
    ("t.int8", VT.INT8, -128),
    ("t.uint16", VT.UINT16, 65535),
    ("t.int16", VT.INT16, -32768),
    ("t.uint32", VT.UINT32, 2**32 - 1),
    ("t.int32", VT.INT32, -(2**31)),
    ("t.float32", VT.FLOAT32, 0.1),  # not exact in float32: widened float32 expected
    ("t.bool.true", VT.BOOL, True),
    ("t.bool.false", VT.BOOL, False),
    ("t.string", VT.STRING, "héllo wörld ✓ \U0001f600"),
    ("t.uint64", VT.UINT64, 2**64 - 1),
    ("t.int64", VT.INT64, -(2**63)),
    ("t.float64", VT.FLOAT64, 1 / 3),
    ("t.float32.nan", VT.FLOAT32, math.nan),
    ("t.float64.inf", VT.FLOAT64, -math.inf),
]
ARRAYS: list[tuple[str, VT, list[Any]]] = [
    ("a.uint8", VT.UINT8, [0, 1, 255]),
    ("a.int8", VT.INT8, [-128, 0, 127]),
    ("a.uint16", VT.UINT16, [0, 65535]),
    ("a.int16", VT.INT16, [-32768, 32767]),
    ("a.uint32", VT.UINT32, [0, 2**32 - 1]),
    ("a.int32", VT.INT32, [-(2**31), 7]),
    ("a.float32", VT.FLOAT32, [0.1, -2.5, math.inf, math.nan]),
    ("a.bool", VT.BOOL, [True, False, True]),
    ("a.string", VT.STRING, ["", "a", "ünïcode", "x" * 300]),
    ("a.uint64", VT.UINT64, [0, 2**64 - 1]),
    ("a.int64", VT.INT64, [-(2**63), 2**63 - 1]),
    ("a.float64", VT.FLOAT64, [1e300, -0.0]),
    ("a.empty.uint32", VT.UINT32, []),
    ("a.empty.string", VT.STRING, []),
]
NESTED: list[tuple[str, list[Any]]] = [
    ("n.int", [[1, 2, 3], [4], [5, 6]]),
    ("n.string", [["a", "bc"], ["déf"]]),
    ("n.deep", [[[1.5, 2.5], [3.5]], [[4.5]]]),
]


def write_model(
    path: Path,
    *,
    endian: gguf.GGUFEndian = LITTLE,
    nested: bool = True,
    tensors: bool = True,
    alignment: int | None = None,
) -> Path:
    writer = Writer(path, "test", endianess=endian)
    for key, vt, value in SCALARS:
        writer.add_key_value(key, value, vt)
    for key, item, values in ARRAYS:
        writer.add_key_value(key, values, VT.ARRAY, sub_type=item)
    if nested:
        for key, values in NESTED:
            writer.add_key_value(key, values, VT.ARRAY)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    if tensors:
        rng = np.random.default_rng(0)
        writer.add_tensor("token_embd.weight", rng.standard_normal((8, 64), dtype=np.float32))
        writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float16))
        writer.add_tensor("blk.0.i8", np.arange(10, dtype=np.int8))
        writer.add_tensor("blk.0.i64", np.arange(3 * 5, dtype=np.int64).reshape(3, 5))
        writer.add_tensor("blk.1.f64", np.zeros((2, 2, 2, 3), dtype=np.float64))
        raw = rng.integers(0, 255, size=(4, 2 * 18), dtype=np.uint8)
        writer.add_tensor("blk.10.attn_q.weight", raw, raw_dtype=QT.Q4_0)
        raw = rng.integers(0, 255, size=(2, 144), dtype=np.uint8)
        writer.add_tensor("blk.2.ffn_up.weight", raw, raw_dtype=QT.Q4_K)
        writer.add_tensor("output.weight", np.zeros((3, 16 * 2), dtype=np.uint8), raw_dtype=QT.BF16)
        writer.add_tensor("rope_freqs.weight", np.zeros(0, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --- the oracles ---------------------------------------------------------------------


def assert_agrees_with_reader(result: dict[str, Any], path: Path) -> None:
    reader = gguf.GGUFReader(path)
    assert json_metadata(result["metadata"]) == reader_metadata(reader)
    (info,) = result["files"]
    assert info["data_offset"] == reader.data_offset
    assert info["alignment"] == reader.alignment
    assert info["byte_order"] == ("big" if reader.endianess == BIG else "little")
    assert info["n_tensors"] == len(reader.tensors) == len(result["tensors"])
    ours = {t["name"]: t for t in result["tensors"]}
    for t in reader.tensors:
        got = ours[t.name]
        assert got["type"] == t.tensor_type.name
        assert got["shape"] == [int(d) for d in t.field.parts[3]]
        assert got["offset"] == t.data_offset
        assert got["nbytes"] == t.n_bytes
        assert got["file"] == 0


def expected_json(vt: VT, value: Any) -> Any:
    """What ``inspect --json`` must print for a written value."""
    if vt == VT.FLOAT32:
        value = float(np.float32(value))
    return norm(value)


# --- tests ---------------------------------------------------------------------------


@pytest.mark.parametrize("endian", [LITTLE, BIG], ids=["little", "big"])
def test_every_value_type(
    endian: gguf.GGUFEndian, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_model(tmp_path / "all.gguf", endian=endian)
    result = run_inspect(capsys, path)
    assert_agrees_with_reader(result, path)
    assert result["files"][0]["byte_order"] == ("big" if endian == BIG else "little")
    assert result["files"][0]["version"] == 3
    meta = result["metadata"]
    assert meta["general.architecture"] == {"type": "string", "value": "test"}
    for key, vt, value in SCALARS:
        assert meta[key] == {"type": vt.name.lower(), "value": expected_json(vt, value)}, key
        assert type(meta[key]["value"]) is type(expected_json(vt, value)), key
    for key, item, values in ARRAYS:
        want = [expected_json(item, v) for v in values]
        assert meta[key] == {"type": "array", "item_type": item.name.lower(), "value": want}, key
    for key, values in NESTED:
        assert meta[key]["item_type"] == "array"
        assert meta[key]["value"] == values, key
    # tensors: layer order, classes, shapes in ggml order
    tensors = result["tensors"]
    assert [t["name"] for t in tensors] == [
        "output.weight",
        "rope_freqs.weight",
        "token_embd.weight",
        "blk.0.attn_norm.weight",
        "blk.0.i64",
        "blk.0.i8",
        "blk.1.f64",
        "blk.2.ffn_up.weight",
        "blk.10.attn_q.weight",
    ]
    by_name = {t["name"]: t for t in tensors}
    assert by_name["blk.0.i64"]["shape"] == [5, 3]
    assert by_name["blk.1.f64"]["shape"] == [3, 2, 2, 2]
    assert by_name["blk.10.attn_q.weight"] == by_name["blk.10.attn_q.weight"] | {
        "type": "Q4_0",
        "shape": [64, 4],
        "nbytes": 4 * 2 * 18,
        "layer": 10,
        "class": "repeating",
    }
    assert by_name["output.weight"]["type"] == "BF16"
    assert by_name["rope_freqs.weight"] | {"nbytes": 0} == by_name["rope_freqs.weight"]
    assert by_name["rope_freqs.weight"]["class"] == "repeating"
    assert by_name["token_embd.weight"]["class"] == "input"


@pytest.mark.asyncio
@pytest.mark.parametrize("endian", [LITTLE, BIG], ids=["little", "big"])
async def test_parsed_records(endian: gguf.GGUFEndian, tmp_path: Path) -> None:
    parsed = await parse_file(write_model(tmp_path / "m.gguf", endian=endian, alignment=64))
    assert parsed.alignment == 64
    assert parsed.data_offset % 64 == 0
    assert not parsed.llama_cpp_loadable
    assert any("array of arrays" in w for w in parsed.warnings)
    f32 = parsed.metadata["t.float32"]
    assert f32.type is ValueType.FLOAT32
    assert f32.value == float(np.float32(0.1)) != 0.1
    assert parsed.metadata["t.bool.true"].value is True
    array = parsed.metadata["a.int64"].value
    assert isinstance(array, GGUFArray)
    assert isinstance(array.values, np.ndarray)
    assert array.values.dtype == np.dtype("=i8")
    assert array.values.dtype.isnative
    assert not array.values.flags.writeable
    assert array.values.tolist() == [-(2**63), 2**63 - 1]
    bools = parsed.metadata["a.bool"].value
    assert isinstance(bools, GGUFArray)
    assert isinstance(bools.values, np.ndarray)
    assert bools.values.dtype == np.bool_
    strings = parsed.metadata["a.string"].value
    assert isinstance(strings, GGUFArray)
    assert strings.values == ("", "a", "ünïcode", "x" * 300)
    deep = parsed.metadata["n.deep"].value
    assert isinstance(deep, GGUFArray)
    assert deep.item_type is ValueType.ARRAY
    assert deep.to_python() == [[[1.5, 2.5], [3.5]], [[4.5]]]
    offsets = {m.key: m.offset for m in parsed.metadata.values()}
    assert offsets["general.architecture"] == 24  # the first record follows the fixed header


def test_no_nested_arrays_is_loadable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_model(tmp_path / "flat.gguf", nested=False, tensors=False)
    result = run_inspect(capsys, path)
    assert_agrees_with_reader(result, path)
    assert result["tensors"] == []
    assert result["totals"] == {"n_tensors": 0, "nbytes": 0, "n_elements": 0, "bpw": 0.0}


@pytest.mark.parametrize("endian", [LITTLE, BIG], ids=["little", "big"])
def test_zero_tensors(
    endian: gguf.GGUFEndian, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    writer = gguf.GGUFWriter(tmp_path / "empty.gguf", "none", endianess=endian)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = run_inspect(capsys, tmp_path / "empty.gguf")
    assert_agrees_with_reader(result, tmp_path / "empty.gguf")
    assert result["metadata"] == {"general.architecture": {"type": "string", "value": "none"}}
    assert result["files"][0]["n_tensors"] == 0


@pytest.mark.asyncio
async def test_big_vocabulary_spans_several_reads(tmp_path: Path) -> None:
    """150k-entry string arrays: a header of several MiB, parsed across growing reads."""
    rng = np.random.default_rng(1)
    alphabet = list("abcdefghijklmnopqrstuvwxyzĠéü▁")
    text = "".join(rng.choice(alphabet, size=900_000))
    cuts = np.cumsum(rng.integers(0, 12, size=150_000)).tolist()
    tokens = [text[a:b] for a, b in zip([0, *cuts[:-1]], cuts, strict=True)]
    merges = [f"{a} {b}" for a, b in zip(tokens[1:], tokens[:-1], strict=False)]
    scores = rng.standard_normal(150_000).astype(np.float32)
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores.tolist())
    writer.add_token_merges(merges)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    parsed = await parse_file(path)
    assert parsed.data_offset > 2 * FIRST_READ_BYTES  # several resumed reads
    got_tokens = parsed.get("tokenizer.ggml.tokens")
    assert isinstance(got_tokens, GGUFArray)
    assert got_tokens.values == tuple(tokens)
    got_merges = parsed.get("tokenizer.ggml.merges")
    assert isinstance(got_merges, GGUFArray)
    assert got_merges.values == tuple(merges)
    got_scores = parsed.get("tokenizer.ggml.scores")
    assert isinstance(got_scores, GGUFArray)
    assert isinstance(got_scores.values, np.ndarray)
    np.testing.assert_array_equal(got_scores.values, scores)
    (tensor,) = parsed.tensors
    assert tensor.offset == 0
    assert tensor.nbytes == 4 * 32 * 4
    # the writer pads the one tensor to 32 bytes and ends the file there
    assert parsed.data_offset == path.stat().st_size - 4 * 32 * 4


def _plain(value: object) -> object:
    return value.to_python() if isinstance(value, GGUFArray) else value


def _summary(parsed: ParsedFile) -> tuple[Any, ...]:
    meta = [
        (
            e.key,
            e.type,
            e.offset,
            e.value.to_python() if isinstance(e.value, GGUFArray) else e.value,
        )
        for e in parsed.metadata.values()
    ]
    return (meta, parsed.tensors, parsed.data_offset, parsed.alignment, parsed.warnings)


@pytest.mark.parametrize("endian", [LITTLE, BIG], ids=["little", "big"])
def test_resumed_parse_equals_one_shot(endian: gguf.GGUFEndian, tmp_path: Path) -> None:
    """Fed only the bytes it asks for, step by step, the parser ends where one pass does."""
    data = write_model(tmp_path / "r.gguf", endian=endian).read_bytes()
    once = parse_header(data, "r.gguf", len(data))
    parser = _HeaderParser("r.gguf", len(data))
    size, steps = 0, 0
    while True:
        try:
            resumed = parser.parse(data[:size])
        except NeedMoreBytes as more:
            needed = more.end
        else:
            break
        assert size < needed <= len(data)
        size, steps = needed, steps + 1
    assert steps > 50
    # repr: NaN values compare unequal, their reprs do not
    assert repr(_summary(resumed)) == repr(_summary(once))
