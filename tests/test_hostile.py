"""Hostile input is normal input: every malformed header ends in a ``GGUFError`` whose
message names the problem — never another exception, never a hang, never an allocation
much beyond the file's own size. Files are built byte by byte with ``struct.pack``.
The fuzz tests are differential: gguf-py's reader must agree with what we parse, and
must refuse what we refuse (``_survives``)."""

from __future__ import annotations

import dataclasses
import json
import re
import struct
import tempfile
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import examples
from gguf_oracle import json_metadata, sandboxed_reader_view
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiogguf._records import GGUFArray, ParsedFile, WeightIndex
from aiogguf.cli.inspect import inspect_json
from aiogguf.errors import GGUFError, GGUFFormatError, SplitError
from aiogguf.stages.index import build_index
from aiogguf.stages.parse import (
    FIRST_READ_BYTES,
    LAZY_STRINGS_FROM,
    NeedMoreBytes,
    parse_file,
    parse_header,
    parse_model,
)

U64_MAX = 2**64 - 1
F32, Q4_0 = 0, 2
UINT32, STRING, ARRAY, UINT64, BOOL = 4, 8, 9, 10, 7


# --- byte builders (little-endian, GGUF v3) -------------------------------------------


def gstr(text: bytes, length: int | None = None) -> bytes:
    """A GGUF string: u64 byte length (default: the true one), then the raw bytes."""
    return struct.pack("<Q", len(text) if length is None else length) + text


def header(n_tensors: int, n_kv: int, *, version: int = 3, magic: bytes = b"GGUF") -> bytes:
    return (
        magic  # magic, never byte-swapped
        + struct.pack("<I", version)  # version
        + struct.pack("<Q", n_tensors)  # tensor_count
        + struct.pack("<Q", n_kv)  # kv_count
    )


def kv(key: bytes, value_type: int, value: bytes) -> bytes:
    return (
        gstr(key)  # key
        + struct.pack("<I", value_type)  # value type
        + value  # value, already encoded
    )


def kv_u32(key: bytes, value: int) -> bytes:
    return kv(key, UINT32, struct.pack("<I", value))


def kv_array(key: bytes, item_type: int, count: int, items: bytes) -> bytes:
    return kv(
        key,
        ARRAY,
        struct.pack("<I", item_type)  # item type
        + struct.pack("<Q", count)  # item count
        + items,  # the items, packed
    )


def tensor_info(name: bytes, dims: list[int], type_id: int, offset: int) -> bytes:
    return (
        gstr(name)  # name
        + struct.pack("<I", len(dims))  # n_dims
        + struct.pack(f"<{len(dims)}Q", *dims)  # ne[0..n_dims-1]
        + struct.pack("<I", type_id)  # ggml type id
        + struct.pack("<Q", offset)  # offset within the data section
    )


def pad(data: bytes, alignment: int = 32) -> bytes:
    return data + b"\0" * (-len(data) % alignment)


def model(
    *,
    kvs: list[bytes] | None = None,
    infos: list[bytes] | None = None,
    data_bytes: int | None = None,
    n_kv: int | None = None,
    n_tensors: int | None = None,
    version: int = 3,
    magic: bytes = b"GGUF",
) -> bytes:
    """A file: header, KVs, tensor infos, padding, ``data_bytes`` of data (zeros)."""
    kvs = [kv(b"general.architecture", STRING, gstr(b"llama"))] if kvs is None else kvs
    infos = TWO_TENSORS if infos is None else infos
    head = header(
        len(infos) if n_tensors is None else n_tensors,
        len(kvs) if n_kv is None else n_kv,
        version=version,
        magic=magic,
    )
    body = pad(head + b"".join(kvs) + b"".join(infos))
    return body + b"\0" * (96 if data_bytes is None else data_bytes)


TWO_TENSORS = [
    tensor_info(b"output_norm.weight", [8], F32, 0),  # 32 bytes at 0
    tensor_info(b"blk.0.attn_q.weight", [32, 2], Q4_0, 32),  # 2 × 18 bytes at 32
]
SMALL_KVS = [
    kv(b"general.architecture", STRING, gstr(b"llama")),
    kv_u32(b"general.alignment", 32),
    kv_array(b"tokenizer.ggml.tokens", STRING, 3, gstr(b"a") + gstr(b"") + gstr(b"\xc3\xa9")),
    kv_array(b"tokenizer.ggml.scores", 6, 2, struct.pack("<2f", 0.5, -1.0)),
]
SMALL = model(kvs=SMALL_KVS)  # data: 32 + 36 = 68 bytes used, 96 written
SMALL_MIN_SIZE = len(SMALL) - 96 + 32 + 36  # the last tensor's padding may be missing


def load(data: bytes, name: str = "hostile.gguf") -> WeightIndex:
    """parse + index of an in-memory file, as ``open_index`` does for a file on disk."""
    return build_index([parse_header(data, name, len(data))])


# --- the table of hand-made cases -------------------------------------------------------

NESTED_DEEP = kv(b"deep", ARRAY, b"".join(struct.pack("<IQ", ARRAY, 1) for _ in range(20)))

CASES: dict[str, tuple[Callable[[], bytes], str]] = {
    "bad magic": (lambda: model(magic=b"GGML"), r"magic.*not a GGUF file"),
    "reversed magic": (lambda: model(magic=b"FUGG"), r"magic.*not a GGUF file"),
    "v1": (lambda: model(version=1), r"version.*v1 is not supported"),
    "v0": (lambda: model(version=0), r"unsupported GGUF version 0"),
    "v4": (lambda: model(version=4), r"unsupported GGUF version 4 \(expected 2 or 3\)"),
    "v1 big-endian": (lambda: model(version=0x01000000), r"v1 is not supported"),
    "tensor_count 2^64-1": (lambda: model(n_tensors=U64_MAX), r"tensor_count.*negative"),
    "tensor_count 2^63": (lambda: model(n_tensors=2**63), r"tensor_count.*negative"),
    "tensor_count absurd": (lambda: model(n_tensors=10**6), r"tensor_count.*at least 24000000"),
    "kv_count 2^64-1": (lambda: model(n_kv=U64_MAX), r"kv_count.*negative"),
    "kv_count absurd": (lambda: model(n_kv=10**5), r"kv_count.*at least 1400000 bytes"),
    # Two more KVs than written: the tensor infos are read as a KV, whose "key" is bad.
    "kv_count short": (lambda: model(n_kv=3), r"metadata #\d key"),
    "unknown value type": (
        lambda: model(kvs=[kv(b"k", 13, b"\0" * 8)]),
        r"metadata 'k' type.*unknown value type 13",
    ),
    "unknown value type 2^32-1": (
        lambda: model(kvs=[kv(b"k", 2**32 - 1, b"")]),
        r"unknown value type 4294967295",
    ),
    "unknown array item type": (
        lambda: model(kvs=[kv_array(b"k", 77, 1, b"\0")]),
        r"item type.*unknown value type 77",
    ),
    "key length 2^64-1": (
        lambda: model(kvs=[gstr(b"k", U64_MAX) + b"\0" * 16]),
        r"metadata #0 key.*string length 18446744073709551615 exceeds the maximum",
    ),
    "key length 2^30+1": (
        lambda: model(kvs=[gstr(b"k", 2**30 + 1) + b"\0" * 16]),
        r"string length 1073741825 exceeds the maximum of 1073741824",
    ),
    "string length past EOF": (
        lambda: model(kvs=[kv(b"k", STRING, gstr(b"abc", 2**20))]),
        r"metadata 'k'.*string length 1048576 exceeds the \d+ bytes left",
    ),
    "string length 2^63": (
        lambda: model(kvs=[kv(b"k", STRING, gstr(b"abc", 2**63))]),
        r"string length 9223372036854775808 exceeds the maximum",
    ),
    "string array item length 2^64-1": (
        lambda: model(kvs=[kv_array(b"k", STRING, 2, gstr(b"a") + gstr(b"b", U64_MAX))]),
        r"metadata 'k'\[1\].*string length 18446744073709551615 exceeds",
    ),
    "array count 2^64-1": (
        lambda: model(kvs=[kv_array(b"k", UINT32, U64_MAX, b"")]),
        r"array count 18446744073709551615 is negative",
    ),
    "array count 2^30+1": (
        lambda: model(kvs=[kv_array(b"k", UINT32, 2**30 + 1, b"")]),
        r"array count 1073741825 exceeds the maximum",
    ),
    "array count past EOF": (
        lambda: model(kvs=[kv_array(b"k", UINT64, 2**29, b"")]),
        r"array of 536870912 uint64 items needs at least 4294967296 bytes",
    ),
    "string array count past EOF": (
        lambda: model(kvs=[kv_array(b"k", STRING, 2**20, b"")]),
        r"array of 1048576 string items needs at least 8388608 bytes",
    ),
    "nested arrays too deep": (lambda: model(kvs=[NESTED_DEEP]), r"nested deeper than 16"),
    "empty key": (lambda: model(kvs=[kv_u32(b"", 1)]), r"metadata #0 key.*empty key"),
    "duplicate key": (
        lambda: model(kvs=[kv_u32(b"a.b", 1), kv_u32(b"a.b", 2)]),
        r"metadata 'a.b'.*duplicate key \(first at offset 24\)",
    ),
    "invalid UTF-8 key": (
        lambda: model(kvs=[kv_u32(b"k\xff", 1)]),
        r"metadata #0 key.*not valid UTF-8",
    ),
    "invalid UTF-8 string value": (
        lambda: model(kvs=[kv(b"k", STRING, gstr(b"\xc3("))]),
        r"metadata 'k'.*not valid UTF-8",
    ),
    "invalid UTF-8 in string array": (
        lambda: model(kvs=[kv_array(b"k", STRING, 2, gstr(b"ok") + gstr(b"\xe2\x82"))]),
        r"metadata 'k'\[1\].*not valid UTF-8",
    ),
    "alignment not a power of two": (
        lambda: model(kvs=[kv_u32(b"general.alignment", 48)]),
        r"general.alignment.*48 is not a power of two",
    ),
    "alignment zero": (
        lambda: model(kvs=[kv_u32(b"general.alignment", 0)]),
        r"general.alignment.*0 is not a power of two",
    ),
    "alignment as uint64": (
        lambda: model(kvs=[kv(b"general.alignment", UINT64, struct.pack("<Q", 32))]),
        r"general.alignment.*must be of type uint32, found uint64",
    ),
    "n_dims 5": (
        lambda: model(infos=[tensor_info(b"t", [1, 1, 1, 1, 1], F32, 0)]),
        r"tensor 't' n_dims.*5 dimensions; at most 4",
    ),
    "n_dims 2^32-1": (
        lambda: model(infos=[gstr(b"t") + struct.pack("<I", 2**32 - 1)]),
        r"n_dims.*4294967295 dimensions",
    ),
    "negative dim": (
        lambda: model(infos=[tensor_info(b"t", [8, U64_MAX], F32, 0)]),
        r"tensor 't' ne\[1\].*18446744073709551615 is negative as int64",
    ),
    "element count overflow": (
        lambda: model(infos=[tensor_info(b"t", [2**32, 2**31], F32, 0)]),
        r"tensor 't' dims.*element count .* overflows int64",
    ),
    "unknown ggml type": (
        lambda: model(infos=[tensor_info(b"t", [8], 43, 0)]),
        r"tensor 't' type.*unknown ggml type id 43 \(expected 0..42\)",
    ),
    "ggml type 2^32-1": (
        lambda: model(infos=[tensor_info(b"t", [8], 2**32 - 1, 0)]),
        r"unknown ggml type id 4294967295",
    ),
    "removed type Q4_2": (
        lambda: model(infos=[tensor_info(b"t", [32], 4, 0)]),
        r"ggml type id 4 \(Q4_2\) was removed",
    ),
    "removed type IQ4_NL_4_4": (
        lambda: model(infos=[tensor_info(b"t", [32], 36, 0)]),
        r"ggml type id 36 \(IQ4_NL_4_4\) was removed",
    ),
    "row not a whole block": (
        lambda: model(infos=[tensor_info(b"t", [16, 2], Q4_0, 0)]),
        r"ne\[0\] = 16 is not a multiple of Q4_0's block of 32",
    ),
    "bytes past 2^64": (
        lambda: model(infos=[tensor_info(b"t", [2**62], 28, 0)]),  # F64: 2^65 bytes
        r"tensor 't'.*do not fit in 64 bits",
    ),
    "offset + size past 2^64": (
        lambda: model(
            infos=[
                tensor_info(b"a", [2**61 - 8], F32, 0),  # 2^63 - 32 bytes
                tensor_info(b"b", [2**61 - 8], F32, 2**63 - 32),  # ends at 2^64 - 64 + data
            ]
        ),
        r"tensor 'b'.*overflows 64 bits",
    ),
    "non-contiguous offsets": (
        lambda: model(infos=[tensor_info(b"a", [8], F32, 0), tensor_info(b"b", [8], F32, 64)]),
        r"tensor 'b' offset.*64, expected 32",
    ),
    "first offset not zero": (
        lambda: model(infos=[tensor_info(b"a", [8], F32, 32)]),
        r"tensor 'a' offset.*32, expected 0",
    ),
    "misaligned offset": (
        lambda: model(infos=[tensor_info(b"a", [3], F32, 0), tensor_info(b"b", [8], F32, 12)]),
        r"tensor 'b' offset.*12, expected 32",
    ),
    "data past EOF": (
        lambda: model(data_bytes=40),  # the Q4_0 tensor needs bytes 32..68
        r"tensor 'blk.0.attn_q.weight'.*not within the file",
    ),
    "data section past EOF": (
        lambda: header(1, 0) + tensor_info(b"t", [0], F32, 0),  # no padding, no data
        r"data section.*starts at 64 .* the file ends at 57 \(truncated\)",
    ),
    "duplicate tensor name": (
        lambda: model(infos=[tensor_info(b"t", [8], F32, 0), tensor_info(b"t", [8], F32, 32)]),
        r"tensor 't'.*duplicate tensor name",
    ),
    "invalid UTF-8 tensor name": (
        lambda: model(infos=[tensor_info(b"\xff\xfe", [8], F32, 0)]),
        r"tensor #0 name.*not valid UTF-8",
    ),
    "tensor name of 64 bytes": (
        lambda: model(infos=[tensor_info(b"n" * 64, [8], F32, 0)]),
        r"tensor #0 name.*64 bytes; the limit is 63",
    ),
    "tensor name length 2^64-1": (
        lambda: model(infos=[gstr(b"t", U64_MAX)]),
        r"tensor #0 name.*string length 18446744073709551615 exceeds the maximum",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hand_made_case(case: str) -> None:
    build, message = CASES[case]
    with pytest.raises(GGUFError, match=message) as info:
        load(build())
    assert str(info.value).startswith("hostile.gguf: ")


def test_well_formed_small_model_loads() -> None:
    index = load(SMALL)
    assert [t.name for t in index.tensors] == ["output_norm.weight", "blk.0.attn_q.weight"]
    assert index.totals.nbytes == 68
    assert index["blk.0.attn_q.weight"].shape == (32, 2)
    assert index.files[0].warnings == ()


# The ways a message can say that the file ends too soon.
TRUNCATED = r"truncated|not within the file|records need at least|bytes left|are left in the file"


def test_every_prefix_is_an_error() -> None:
    """Truncation anywhere before the last tensor's last byte is an error; after, fine."""
    for size in range(len(SMALL) + 1):
        data = SMALL[:size]
        if size >= SMALL_MIN_SIZE:
            assert load(data).totals.n_tensors == 2
            continue
        with pytest.raises(GGUFError, match=TRUNCATED):
            load(data)


@pytest.mark.asyncio
async def test_every_prefix_through_the_file_reader(tmp_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    for size in range(0, SMALL_MIN_SIZE, 7):
        path.write_bytes(SMALL[:size])
        with pytest.raises(GGUFError):
            build_index(await parse_model(path))


def test_odd_bool_is_a_warning() -> None:
    data = model(
        kvs=[
            kv(b"b", BOOL, b"\x02"),  # a bool byte other than 0 or 1
            kv_array(b"bs", BOOL, 3, b"\x00\x01\x07"),
        ]
    )
    parsed = load(data).files[0]
    assert parsed.metadata["b"].value is True
    assert any("bool byte 2" in w for w in parsed.warnings)
    assert any("bool array" in w for w in parsed.warnings)


def test_small_alignment_is_a_warning() -> None:
    infos = [tensor_info(b"a", [8], F32, 0), tensor_info(b"b", [1], F32, 32)]
    parsed = load(model(kvs=[kv_u32(b"general.alignment", 4)], infos=infos)).files[0]
    assert parsed.alignment == 4
    assert any("general.alignment is 4" in w for w in parsed.warnings)


def test_index_overflow_guard() -> None:
    parsed = parse_header(SMALL, "x.gguf", len(SMALL))
    far = dataclasses.replace(parsed.tensors[1], offset=2**64 - 40)
    hostile: ParsedFile = dataclasses.replace(parsed, tensors=(parsed.tensors[0], far))
    with pytest.raises(GGUFFormatError, match=r"overflows 64 bits"):
        build_index([hostile])


@pytest.mark.asyncio
async def test_hostile_split_count(tmp_path: Path) -> None:
    path = tmp_path / "m-00001-of-99999.gguf"
    path.write_bytes(model(kvs=[kv(b"split.count", UINT64, struct.pack("<Q", 2**40))]))
    with pytest.raises(SplitError, match=r"split.count 1099511627776 exceeds 65535"):
        await parse_model(path)


# --- memory: a hostile header never costs more than the file ------------------------

# Cases whose claims exceed even the 3 MB the memory test appends.
MEMORY_CASES = [
    "key length 2^64-1",
    "string length 2^63",
    "array count 2^30+1",
    "array count past EOF",
    "string array count past EOF",
    "tensor_count absurd",
    "kv_count 2^64-1",
    "bytes past 2^64",
    "nested arrays too deep",
]


@pytest.mark.asyncio
@pytest.mark.parametrize("case", MEMORY_CASES)
async def test_hostile_header_allocates_little(case: str, tmp_path: Path) -> None:
    build, message = CASES[case]
    data = build() + b"\0" * 3_000_000  # a larger file, so growth would show
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data)
    tracemalloc.start()
    try:
        with pytest.raises(GGUFError, match=message):
            await parse_file(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The first read (1 MiB) is all it costs: nothing the header claims is allocated.
    assert peak < FIRST_READ_BYTES + 2**20, f"{case}: peak {peak} bytes"
    assert peak < len(data) + 4 * 2**20


# --- property tests --------------------------------------------------------------------

FUZZ = settings(
    max_examples=examples(default=60, ci=150),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


# Where we refuse on purpose what gguf-py's reader takes: llama.cpp's C reader (gguf.cpp),
# which we follow, checks that strings are UTF-8, that tensor names fit its 64-byte
# buffer, and that each tensor's data starts where the one before it ends (aligned).
STRICTER_THAN_GGUF_PY = re.compile(
    r"not valid UTF-8|name.*the limit is 63|offset: \d+, expected \d+"
)


def _survives(data: bytes) -> None:
    """``data`` parses, or fails with one ``GGUFError`` naming the file; and gguf-py's
    reader (sandboxed: it is not safe on such input) agrees: it reads the same keys,
    values and tensors from a file we parse, and fails on a file we refuse (unless we
    refuse it for a rule of llama.cpp's that gguf-py does not check)."""
    with tempfile.TemporaryDirectory() as tmp:  # hypothesis: no function-scoped tmp_path
        path = Path(tmp) / "hostile.gguf"
        path.write_bytes(data)
        theirs = sandboxed_reader_view(path)
    try:
        index = load(data)
    except GGUFError as exc:
        failure = str(exc)
        assert failure.startswith("hostile.gguf: ")
        if isinstance(theirs, dict):
            assert STRICTER_THAN_GGUF_PY.search(failure), (
                f"we refuse a file gguf-py reads: {failure}"
            )
        return
    assert isinstance(theirs, dict), f"we parse a file gguf-py refuses: {theirs}"
    ours = inspect_json(index)
    nested = any(
        e["type"] == "array" and e.get("item_type") == "array" for e in ours["metadata"].values()
    )
    # Through JSON, as the oracle's answer came: tuples become lists on both sides.
    metadata = json.loads(json.dumps(json_metadata(ours["metadata"], flat=nested)))
    assert metadata == theirs["metadata"]
    tensors = {
        t["name"]: {k: t[k] for k in ("type", "shape", "offset", "nbytes")} for t in ours["tensors"]
    }
    assert tensors == theirs["tensors"]


@FUZZ
@given(
    st.lists(st.tuples(st.integers(0, len(SMALL) - 1), st.integers(0, 255)), min_size=1, max_size=8)
)
def test_random_byte_changes(changes: list[tuple[int, int]]) -> None:
    data = bytearray(SMALL)
    for at, value in changes:
        data[at] = value
    _survives(bytes(data))


# Where SMALL holds u64 counts and lengths (the fields an attacker would choose).
_U64_FIELDS = [8, 16] + [
    i for i in range(24, len(SMALL) - 96 - 8) if SMALL[i + 1 : i + 8] == b"\0" * 7
]


@FUZZ
@given(
    st.sampled_from(_U64_FIELDS),
    st.one_of(
        st.integers(0, 2**64 - 1),
        st.sampled_from([2**30, 2**30 + 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, U64_MAX]),
    ),
    st.integers(0, len(SMALL)),
)
def test_random_u64_fields(at: int, value: int, cut: int) -> None:
    data = bytearray(SMALL)
    struct.pack_into("<Q", data, at, value)
    _survives(bytes(data[: max(cut, at + 8)]))


@FUZZ
@given(st.binary(max_size=400), st.sampled_from([2, 3, 0x02000000, 0x03000000]))
def test_random_bytes_after_header(tail: bytes, version: int) -> None:
    _survives(b"GGUF" + struct.pack("<I", version) + tail)


@FUZZ
@given(st.binary(min_size=0, max_size=64), st.integers(0, len(SMALL)))
def test_random_splices(junk: bytes, at: int) -> None:
    _survives(SMALL[:at] + junk + SMALL[at + len(junk) :])


def test_version_2_and_big_endian_by_hand() -> None:
    assert load(model(version=2)).files[0].version == 2
    big = (
        b"GGUF"  # magic, never swapped
        + struct.pack(">I", 2)  # version 2, big-endian
        + struct.pack(">Q", 1)  # tensor_count
        + struct.pack(">Q", 1)  # kv_count
        + struct.pack(">Q", 1)  # key length
        + b"k"  # key
        + struct.pack(">I", UINT32)  # value type
        + struct.pack(">I", 0x01020304)  # value
        + struct.pack(">Q", 1)  # tensor name length
        + b"t"  # tensor name
        + struct.pack(">I", 1)  # n_dims
        + struct.pack(">Q", 8)  # ne[0]
        + struct.pack(">I", F32)  # type
        + struct.pack(">Q", 0)  # offset
    )
    index = load(pad(big) + b"\0" * 32)
    parsed = index.files[0]
    assert (parsed.version, parsed.byte_order) == (2, "big")
    assert parsed.metadata["k"].value == 0x01020304
    assert index["t"].shape == (8,)
    assert index["t"].nbytes == 32


def test_unknown_tensor_name_is_input_with_a_warning() -> None:
    index = load(model(infos=[tensor_info(b"mystery.weight", [8], F32, 0)]))
    assert index["mystery.weight"].tensor_class.value == "input"
    assert index.warnings == ("tensor 'mystery.weight': unknown name, classed as input",)


def test_short_buffer_asks_for_more() -> None:
    with pytest.raises(NeedMoreBytes) as info:
        parse_header(SMALL[:50], "x.gguf", len(SMALL))
    assert 50 < info.value.end <= len(SMALL)
    assert parse_header(memoryview(SMALL), "x.gguf", len(SMALL)).tensors[1].offset == 32


# --- long string arrays: walked at parse, decoded on first use -------------------------


def _vocab(count: int, bad: int | None = None) -> tuple[bytes, list[bytes]]:
    words = [f"t{i}".encode() for i in range(count)]
    if bad is not None:
        words[bad] = b"x\xc3("  # a two-byte sequence cut short
    return kv_array(b"tokenizer.ggml.tokens", STRING, count, b"".join(map(gstr, words))), words


def test_a_long_string_array_is_decoded_on_first_use_and_equals_its_items() -> None:
    entry, words = _vocab(LAZY_STRINGS_FROM + 5)
    parsed = parse_header(model(kvs=[entry]), "vocab.gguf", len(model(kvs=[entry])))
    tokens = parsed.get("tokenizer.ggml.tokens")
    assert isinstance(tokens, GGUFArray)
    assert len(tokens) == len(words)
    assert "not decoded yet" in repr(tokens)
    assert tokens.values == tuple(w.decode() for w in words)
    assert tokens.values[3] == "t3"
    assert list(tokens.values)[-1] == words[-1].decode()
    assert tokens.to_python() == [w.decode() for w in words]


def test_invalid_utf8_in_a_long_string_array_is_named_when_it_is_used() -> None:
    """A load needs no vocabulary: invalid UTF-8 in a long one is not a parse error, but
    reading the items raises one that names the item and its offset."""
    bad = LAZY_STRINGS_FROM + 2
    entry, _ = _vocab(LAZY_STRINGS_FROM + 9, bad=bad)
    data = model(kvs=[entry])
    parsed = parse_header(data, "vocab.gguf", len(data))
    tokens = parsed.get("tokenizer.ggml.tokens")
    assert isinstance(tokens, GGUFArray)
    with pytest.raises(GGUFFormatError, match=rf"tokenizer\.ggml\.tokens'\[{bad}\]") as caught:
        tokens.values[0]
    # The offset of the bad byte: after the item's 8-byte length and its "x".
    assert caught.value.offset == data.index(b"x\xc3(") + 1
    # A short array is decoded at once: the same item fails the parse.
    short, _ = _vocab(LAZY_STRINGS_FROM - 1, bad=3)
    with pytest.raises(GGUFFormatError, match=r"not valid UTF-8"):
        parse_header(model(kvs=[short]), "vocab.gguf", len(model(kvs=[short])))


def test_a_long_string_array_cut_short_names_its_item() -> None:
    entry, _ = _vocab(LAZY_STRINGS_FROM + 40)
    data = model(kvs=[entry])
    cut = data.index(b"t290")  # inside the array
    with pytest.raises(GGUFFormatError, match=r"tokenizer\.ggml\.tokens'\[290\]: string length"):
        parse_header(data[:cut], "vocab.gguf", cut)


@given(cut=st.integers(min_value=40, max_value=4000))
@settings(max_examples=examples(default=40, ci=100), deadline=None)
def test_a_long_string_array_parses_the_same_across_any_split_of_reads(cut: int) -> None:
    """The walk resumes where a short buffer stopped it (``NeedMoreBytes``)."""
    entry, words = _vocab(LAZY_STRINGS_FROM + 60)
    data = model(kvs=[entry])
    from aiogguf.stages.parse import _HeaderParser

    parser = _HeaderParser("vocab.gguf", len(data))
    try:
        parsed = parser.parse(data[:cut])
    except NeedMoreBytes:
        parsed = parser.parse(data)
    tokens = parsed.get("tokenizer.ggml.tokens")
    assert isinstance(tokens, GGUFArray)
    assert tokens.values == tuple(w.decode() for w in words)
