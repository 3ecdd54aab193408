"""The synthetic model writer, checked against gguf's own reader and raw bytes.

Scale offsets are restated here from format §4.2 rather than taken from
``aiogguf.io.ggml_types``, so a wrong row in that table cannot hide in both places.
"""

from __future__ import annotations

import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from helpers_gguf import write_gguf

from aiogguf.testing.synth import (
    Corruption,
    CorruptionKind,
    SynthModel,
    SynthTensor,
    write_synthetic_model,
)
from aiogguf.testing.synth_cache import default_demo_path, ensure_synthetic_model

MiB = 1024**2
VT = gguf.GGUFValueType

# type name -> (offset in block, kind) of every scale field ggml's validator checks.
SCALES: dict[str, list[tuple[int, str]]] = {
    "Q4_0": [(0, "fp16")],
    "Q4_1": [(0, "fp16"), (2, "fp16")],
    "Q5_0": [(0, "fp16")],
    "Q5_1": [(0, "fp16"), (2, "fp16")],
    "Q8_0": [(0, "fp16")],
    "Q8_1": [(0, "fp16")],
    "Q2_K": [(80, "fp16"), (82, "fp16")],
    "Q3_K": [(108, "fp16")],
    "Q4_K": [(0, "fp16"), (2, "fp16")],
    "Q5_K": [(0, "fp16"), (2, "fp16")],
    "Q6_K": [(208, "fp16")],
    "Q8_K": [(0, "f32")],
    "IQ2_XXS": [(0, "fp16")],
    "IQ2_XS": [(0, "fp16")],
    "IQ3_XXS": [(0, "fp16")],
    "IQ1_S": [(0, "fp16")],
    "IQ4_NL": [(0, "fp16")],
    "IQ3_S": [(0, "fp16")],
    "IQ2_S": [(0, "fp16")],
    "IQ4_XS": [(0, "fp16")],
    "IQ1_M": [(48, "iq1m")],
    "TQ1_0": [(52, "fp16")],
    "TQ2_0": [(64, "fp16")],
    "MXFP4": [(0, "e8m0")],
    "NVFP4": [],
    "Q1_0": [(0, "fp16")],
    "Q2_0": [(0, "fp16")],
}
# (elements, bytes) per block; gguf-py lacks Q2_0 and says 40 for Q8_1 where ggml's C has 36.
BLOCKS = {t.name: s for t, s in gguf.GGML_QUANT_SIZES.items()} | {
    "Q2_0": (64, 18),
    "Q8_1": (32, 36),
}
FLOATS = {"F32": "f4", "F16": "f2", "F64": "f8"}
ALL_VALID = [*FLOATS, "BF16", "I8", "I16", "I32", "I64", *SCALES]


def tensor_bytes(model: SynthModel, t: SynthTensor) -> np.ndarray:
    with open(model.paths[t.shard], "rb") as f:
        f.seek(t.file_offset)
        return np.frombuffer(f.read(t.nbytes), np.uint8)


def bad_indices(raw: np.ndarray, type_name: str, big_endian: bool = False) -> set[int]:
    """Elements (plain types) or blocks (quantized) whose value or checked scale is NaN/Inf."""
    order = ">" if big_endian else "<"
    if type_name in FLOATS:
        return set(np.flatnonzero(~np.isfinite(raw.view(order + FLOATS[type_name]))).tolist())
    if type_name == "BF16":
        bits = raw.view(order + "u2")
        return set(np.flatnonzero((bits & 0x7FFF) >= 0x7F80).tolist())
    if type_name not in SCALES:
        return set()
    blocks = raw.reshape(-1, BLOCKS[type_name][1])
    bad = np.zeros(len(blocks), bool)
    for offset, kind in SCALES[type_name]:
        if kind == "e8m0":
            bad |= blocks[:, offset] == 0xFF
            continue
        if kind == "iq1m":
            hi = (blocks[:, [49, 51, 53, 55]] >> 4).astype(np.uint16)
            if big_endian:
                hi = (blocks[:, [48, 50, 52, 54]] >> 4).astype(np.uint16)
            bits = hi[:, 0] | hi[:, 1] << 4 | hi[:, 2] << 8 | hi[:, 3] << 12
            values = bits.view(np.float16)
        else:
            width = 4 if kind == "f32" else 2
            field = np.ascontiguousarray(blocks[:, offset : offset + width])
            values = field.view(order + ("f4" if kind == "f32" else "f2")).ravel()
        bad |= ~np.isfinite(values)
    return set(np.flatnonzero(bad).tolist())


def kv(reader: gguf.GGUFReader, key: str) -> tuple[object, VT]:
    field = reader.fields[key]
    return field.contents(), field.types[0]


def test_mixed_model_reads_back_as_intended(tmp_path: Path) -> None:
    model = write_synthetic_model(tmp_path / "m.gguf", size_bytes=8 * MiB, seed=3)
    reader = gguf.GGUFReader(model.path)

    n_layer = model.n_layer
    assert model.n_tensors == 9 * n_layer + 3 == len(reader.tensors)
    names = [t.name for t in reader.tensors]
    assert names[0] == "token_embd.weight"
    assert names[-2:] == ["output_norm.weight", "output.weight"]
    assert names[1:10] == [
        f"blk.0.{b}.weight"
        for b in (
            "attn_norm",
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_norm",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
        )
    ]
    types = {t.name.split(".")[-2]: t.tensor_type.name for t in reader.tensors}
    assert types == {
        "token_embd": "F16",
        "attn_norm": "F32",
        "ffn_norm": "F32",
        "output_norm": "F32",
        "attn_q": "Q4_K",
        "attn_k": "Q4_K",
        "attn_v": "Q8_0",
        "attn_output": "Q4_K",
        "ffn_gate": "Q4_K",
        "ffn_up": "Q4_K",
        "ffn_down": "Q8_0",
        "output": "Q6_K",
    }
    e, ff, v = model.n_embd, model.n_ff, model.n_vocab
    e_kv = e // model.n_head * model.n_head_kv
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    assert shapes["token_embd.weight"] == (e, v) == shapes["output.weight"]
    assert shapes["blk.1.attn_k.weight"] == (e, e_kv)
    assert shapes["blk.1.ffn_down.weight"] == (ff, e)
    assert shapes["blk.1.ffn_up.weight"] == (e, ff)
    assert shapes["blk.0.attn_norm.weight"] == (e,)
    assert e % 256 == 0
    assert ff % 256 == 0

    assert kv(reader, "general.architecture") == ("llama", VT.STRING)
    assert kv(reader, "llama.block_count") == (n_layer, VT.UINT32)
    assert kv(reader, "llama.embedding_length") == (e, VT.UINT32)
    assert kv(reader, "llama.feed_forward_length") == (ff, VT.UINT32)
    assert kv(reader, "llama.context_length") == (4096, VT.UINT32)
    assert kv(reader, "llama.attention.head_count") == (model.n_head, VT.UINT32)
    assert kv(reader, "llama.attention.head_count_kv") == (model.n_head_kv, VT.UINT32)
    assert kv(reader, "llama.rope.dimension_count") == (e // model.n_head, VT.UINT32)
    assert kv(reader, "general.file_type") == (int(gguf.LlamaFileType.MOSTLY_Q4_K_M), VT.UINT32)
    assert kv(reader, "general.quantization_version") == (2, VT.UINT32)
    eps, eps_type = kv(reader, "llama.attention.layer_norm_rms_epsilon")
    assert eps_type is VT.FLOAT32
    assert eps == pytest.approx(1e-5)
    assert isinstance(kv(reader, "general.name")[0], str)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert 256 < len(tokens) == v < 1000
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert len(reader.fields["tokenizer.ggml.scores"].contents()) == v
    assert reader.fields["tokenizer.ggml.token_type"].types == [VT.ARRAY, VT.INT32]

    # The record agrees with the reader on every tensor's place and size.
    for rt, st in zip(reader.tensors, model.tensors, strict=True):
        assert (st.name, st.type_name, st.n_elements) == (
            rt.name,
            rt.tensor_type.name,
            rt.n_elements,
        )
        assert (st.file_offset, st.nbytes) == (rt.data_offset, rt.n_bytes)
        assert st.offset == rt.data_offset - reader.data_offset
    assert model.tensor_bytes == sum(t.n_bytes for t in reader.tensors)
    assert model.file_bytes == model.path.stat().st_size


def test_mixed_model_data_is_valid(tmp_path: Path) -> None:
    model = write_synthetic_model(tmp_path / "m.gguf", size_bytes=8 * MiB, seed=1)
    for t in model.tensors:
        assert bad_indices(tensor_bytes(model, t), t.type_name) == set(), t.name
    # Scales are small positive numbers, not just "finite".
    q4k = tensor_bytes(model, model.tensor("blk.0.attn_q.weight")).reshape(-1, 144)
    d = np.ascontiguousarray(q4k[:, :2]).view("<f2").ravel().astype(np.float64)
    assert ((d >= 9e-5) & (d <= 1.01e-2)).all()


def test_all_types_has_every_valid_type_with_valid_scales(tmp_path: Path) -> None:
    model = write_synthetic_model(
        tmp_path / "a.gguf", size_bytes=2 * MiB, types="all-types", include_q2_0=False
    )
    reader = gguf.GGUFReader(model.path)
    present = {t.tensor_type.name for t in reader.tensors}
    assert present == set(ALL_VALID) - {"Q8_1", "Q2_0"}
    for rt in reader.tensors:
        raw = np.asarray(rt.data).view(np.uint8).ravel()
        assert bad_indices(raw, rt.tensor_type.name) == set(), rt.name
        mx = rt.tensor_type.name == "MXFP4"
        if mx:
            e = raw.reshape(-1, 17)[:, 0]
            assert ((e >= 100) & (e <= 140)).all()


def test_all_types_with_q2_0_and_q8_1(tmp_path: Path) -> None:
    model = write_synthetic_model(
        tmp_path / "a.gguf", size_bytes=2 * MiB, types="all-types", include_q8_1=True
    )
    assert {t.type_name for t in model.tensors} == set(ALL_VALID)
    q2 = model.tensors_of_type("Q2_0")[0]
    assert q2.type_id == 42
    assert q2.nbytes == q2.n_elements // 64 * 18
    assert bad_indices(tensor_bytes(model, q2), "Q2_0") == set()
    # gguf 0.19's reader does not know type 42: the documented reason for include_q2_0=False.
    with pytest.raises(ValueError, match="42"):
        gguf.GGUFReader(model.path)


def test_corruptions_land_exactly_where_requested(tmp_path: Path) -> None:
    base = write_synthetic_model(
        tmp_path / "clean.gguf", size_bytes=2 * MiB, types="all-types", include_q2_0=False
    )

    def first(type_name: str) -> SynthTensor:
        return base.tensors_of_type(type_name)[0]

    wanted = {
        Corruption(first("Q4_K").name, CorruptionKind.NAN_SCALE, 3): {3},
        Corruption(first("F16").name, "inf_element", 5): {5},
        Corruption(first("Q8_0").name, "ff_fill", 2, length=3 * 34): {2, 3, 4},
        Corruption(first("BF16").name, "bf16_nan", 7): {7},
        Corruption(first("IQ1_M").name, "nan_scale", 1): {1},
        Corruption(first("MXFP4").name, "nan_scale", 4): {4},
        Corruption(first("Q6_K").name, "nan_scale", 0): {0},
        Corruption(first("Q8_K").name, "nan_scale", 2): {2},
        Corruption(first("F32").name, "inf_element", 0): {0},
    }
    bad = write_synthetic_model(
        tmp_path / "bad.gguf",
        size_bytes=2 * MiB,
        types="all-types",
        include_q2_0=False,
        corruptions=list(wanted),
    )
    assert bad.corruptions == tuple(wanted)
    assert [t.name for t in bad.tensors] == [t.name for t in base.tensors]
    by_tensor = {c.tensor: want for c, want in wanted.items()}
    for t in bad.tensors:
        assert bad_indices(tensor_bytes(bad, t), t.type_name) == by_tensor.get(t.name, set())

    # Nothing else moved: the files differ only inside the corrupted ranges.
    clean = np.fromfile(base.path, np.uint8)
    dirty = np.fromfile(bad.path, np.uint8)
    assert clean.shape == dirty.shape
    diff = set(np.flatnonzero(clean != dirty).tolist())
    allowed: set[int] = set()
    for c in wanted:
        t = bad.tensor(c.tensor)
        unit = BLOCKS.get(t.type_name, (1, t.nbytes // t.n_elements))[1]
        span = c.length if c.kind == "ff_fill" else unit
        allowed |= set(range(t.file_offset + c.index * unit, t.file_offset + c.index * unit + span))
    assert diff
    assert diff <= allowed
    # The exact bit patterns asked for.
    q4k = bad.tensor(first("Q4_K").name)
    assert bytes(dirty[q4k.file_offset + 3 * 144 : q4k.file_offset + 3 * 144 + 2]) == b"\x00\x7e"
    q8 = bad.tensor(first("Q8_0").name)
    assert (dirty[q8.file_offset + 68 : q8.file_offset + 68 + 102] == 0xFF).all()
    bf = bad.tensor(first("BF16").name)
    assert bytes(dirty[bf.file_offset + 14 : bf.file_offset + 16]) == b"\xc0\x7f"


@pytest.mark.parametrize(
    ("corruption", "match"),
    [
        (Corruption("nope.weight", "nan_scale", 0), "lacks"),
        (Corruption("blk.0.attn_norm.weight", "nan_scale", 0), "no checked scale"),
        (Corruption("blk.0.attn_q.weight", "inf_element", 0), "needs an F32"),
        (Corruption("token_embd.weight", "bf16_nan", 0), "needs a BF16"),
        (Corruption("blk.0.attn_q.weight", "nan_scale", 10**9), "out of range"),
        (Corruption("blk.0.attn_norm.weight", "ff_fill", 0, length=10**9), "passes the end"),
    ],
)
def test_bad_corruption_is_refused_before_writing(
    tmp_path: Path, corruption: Corruption, match: str
) -> None:
    path = tmp_path / "x.gguf"
    with pytest.raises(ValueError, match=match):
        write_synthetic_model(path, size_bytes=MiB, corruptions=[corruption])
    assert not path.exists()


def test_corruption_record_checks_its_fields() -> None:
    with pytest.raises(ValueError, match="nan_scales"):
        Corruption("t", "nan_scales", 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="index"):
        Corruption("t", "ff_fill", -1)


def test_split_files_and_keys(tmp_path: Path) -> None:
    model = write_synthetic_model(tmp_path / "s.gguf", size_bytes=4 * MiB, split_count=3)
    assert [p.name for p in model.paths] == [f"s-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert not (tmp_path / "s.gguf").exists()
    readers = [gguf.GGUFReader(p) for p in model.paths]
    for i, r in enumerate(readers):
        assert kv(r, "split.no") == (i, VT.UINT16)
        assert kv(r, "split.count") == (3, VT.UINT16)
        assert kv(r, "split.tensors.count") == (model.n_tensors, VT.INT32)
        assert r.tensors, "every shard holds tensors"
        assert all(t.shard == i for t in model.tensors if t.name in {x.name for x in r.tensors})
    own = {k for k in readers[1].fields if not k.startswith("GGUF.")}
    assert own == {"split.no", "split.count", "split.tensors.count"}
    assert "general.architecture" in readers[0].fields
    assert "llama.block_count" in readers[0].fields
    names = [t.name for r in readers for t in r.tensors]
    assert names == [t.name for t in model.tensors]
    sizes = [sum(t.n_bytes for t in r.tensors) for r in readers]
    assert max(sizes) < 0.6 * sum(sizes), "bytes are spread over the shards"


def test_size_is_close_to_the_target(tmp_path: Path) -> None:
    model = write_synthetic_model(tmp_path / "m.gguf", size_bytes="64MiB")
    assert abs(model.tensor_bytes - 64 * MiB) < 0.05 * 64 * MiB
    assert model.file_bytes - model.tensor_bytes < MiB


@pytest.mark.timing
def test_writes_fast(tmp_path: Path) -> None:
    started = time.perf_counter()
    write_synthetic_model(tmp_path / "m.gguf", size_bytes="64MiB")
    elapsed = time.perf_counter() - started
    assert elapsed < 10, f"64 MiB took {elapsed:.1f} s"


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    a = write_synthetic_model(tmp_path / "a.gguf", size_bytes=MiB, seed=5)
    b = write_synthetic_model(tmp_path / "b.gguf", size_bytes=MiB, seed=5)
    c = write_synthetic_model(tmp_path / "c.gguf", size_bytes=MiB, seed=6)
    assert a.path.read_bytes() == b.path.read_bytes()
    assert tensor_bytes(a, a.tensors[-1]).tobytes() != tensor_bytes(c, c.tensors[-1]).tobytes()


def test_big_endian_float_model(tmp_path: Path) -> None:
    f16 = "blk.0.ffn_up.weight"
    model = write_synthetic_model(
        tmp_path / "be.gguf",
        size_bytes=2 * MiB,
        big_endian=True,
        corruptions=[Corruption(f16, "inf_element", 9)],
    )
    reader = gguf.GGUFReader(model.path)
    assert reader.endianess is gguf.GGUFEndian.BIG
    assert model.path.read_bytes()[4:8] == b"\x00\x00\x00\x03"
    assert kv(reader, "llama.block_count") == (model.n_layer, VT.UINT32)
    assert {t.tensor_type.name for t in reader.tensors} == {"F32", "F16", "BF16"}
    for rt, st in zip(reader.tensors, model.tensors, strict=True):
        assert (rt.name, rt.data_offset, rt.n_bytes) == (st.name, st.file_offset, st.nbytes)
        raw = tensor_bytes(model, st)
        want = {9} if rt.name == f16 else set()
        assert bad_indices(raw, st.type_name, big_endian=True) == want, rt.name
        if rt.tensor_type.name in FLOATS:
            # The reader swaps to host order: it sees the same finite values and the Inf.
            values = np.asarray(rt.data).ravel()
            assert set(np.flatnonzero(~np.isfinite(values)).tolist()) == want
            assert np.array_equal(values, raw.view(">" + FLOATS[st.type_name]))


def test_big_endian_quantized_scales_are_swapped(tmp_path: Path) -> None:
    model = write_synthetic_model(
        tmp_path / "beq.gguf", size_bytes=2 * MiB, big_endian=True, types="mixed"
    )
    reader = gguf.GGUFReader(model.path)
    assert reader.endianess is gguf.GGUFEndian.BIG
    q4k = model.tensor("blk.0.attn_q.weight")
    assert q4k.type_name == "Q4_K"
    d = np.ascontiguousarray(tensor_bytes(model, q4k).reshape(-1, 144)[:, :2]).view(">f2")
    assert ((d >= 9e-5) & (d <= 1.01e-2)).all()
    for t in model.tensors:
        assert bad_indices(tensor_bytes(model, t), t.type_name, big_endian=True) == set()


def test_uniform_type_preset_and_unknown_preset(tmp_path: Path) -> None:
    model = write_synthetic_model(tmp_path / "q.gguf", size_bytes=MiB, types="q5_k", n_layer=2)
    assert model.n_layer == 2
    assert {t.type_name for t in model.tensors} == {"Q5_K", "F32"}
    assert "general.file_type" not in gguf.GGUFReader(model.path).fields
    with pytest.raises(ValueError, match="unknown types preset"):
        write_synthetic_model(tmp_path / "x.gguf", types="fancy")
    with pytest.raises(ValueError, match="removed"):
        write_synthetic_model(tmp_path / "x.gguf", types="Q4_2")
    with pytest.raises(ValueError, match="n_layer >= 5"):
        write_synthetic_model(tmp_path / "x.gguf", types="all-types", n_layer=2)


def test_custom_alignment(tmp_path: Path) -> None:
    model = write_synthetic_model(tmp_path / "al.gguf", size_bytes=MiB, alignment=256)
    reader = gguf.GGUFReader(model.path)
    assert kv(reader, "general.alignment") == (256, VT.UINT32)
    assert all(t.file_offset % 256 == 0 for t in model.tensors)
    with pytest.raises(ValueError, match="split"):
        write_synthetic_model(tmp_path / "x.gguf", alignment=64, split_count=2)


def test_default_demo_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_demo_path(tmp_path) == tmp_path / "demo-1GiB-s0.gguf"
    assert default_demo_path(str(tmp_path), size_bytes="64MiB", seed=2, types="f16") == (
        tmp_path / "demo-64MiB-s2-f16.gguf"
    )
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_demo_path() == tmp_path / "xdg" / "aiogguf" / "demo-1GiB-s0.gguf"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_demo_path() == tmp_path / "home" / ".cache" / "aiogguf" / "demo-1GiB-s0.gguf"
    assert not (tmp_path / "home").exists()


def test_ensure_reuses_a_complete_model(tmp_path: Path) -> None:
    path = default_demo_path(tmp_path / "cache", size_bytes=MiB)
    model, written = ensure_synthetic_model(path, size_bytes=MiB)
    assert written
    assert path.is_file()
    again, written = ensure_synthetic_model(path, size_bytes=MiB)
    assert not written
    assert again == model

    with open(path, "r+b") as f:  # an interrupted earlier write
        f.truncate(path.stat().st_size - 10)
    repaired, written = ensure_synthetic_model(path, size_bytes=MiB)
    assert written
    assert repaired == model
    assert path.stat().st_size == model.file_bytes

    _, written = ensure_synthetic_model(path, size_bytes=MiB, seed=1)
    assert written, "other arguments mean another model"


def test_helper_write_gguf_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((3, 32)).astype(np.float32)
    q8 = rng.bytes(2 * 34)
    path = write_gguf(
        tmp_path / "h.gguf",
        {
            "general.architecture": "llama",
            "llama.block_count": np.uint32(2),
            "big": np.uint64(2**40),
            "typed": (7, VT.INT16),
            "flag": True,
            "names": ["a", "b"],
            "ids": [np.uint32(1), np.uint32(2)],
        },
        [("a.weight", f32), ("q.weight", (q8, int(gguf.GGMLQuantizationType.Q8_0), (2, 32)))],
        alignment=64,
    )
    reader = gguf.GGUFReader(path)
    assert kv(reader, "general.architecture") == ("llama", VT.STRING)
    assert kv(reader, "llama.block_count") == (2, VT.UINT32)
    assert kv(reader, "big") == (2**40, VT.UINT64)
    assert kv(reader, "typed") == (7, VT.INT16)
    assert kv(reader, "flag") == (True, VT.BOOL)
    assert reader.fields["names"].contents() == ["a", "b"]
    assert reader.fields["ids"].types == [VT.ARRAY, VT.UINT32]
    assert reader.alignment == 64
    a, q = reader.tensors
    assert np.array_equal(a.data, f32)
    assert tuple(a.shape) == (32, 3)
    assert q.tensor_type is gguf.GGMLQuantizationType.Q8_0
    assert tuple(q.shape) == (32, 2)
    assert q.data.tobytes() == q8

    be = write_gguf(tmp_path / "be.gguf", {"k": np.uint32(5)}, [("a", f32)], endian="big")
    reader = gguf.GGUFReader(be)
    assert "general.architecture" not in reader.fields
    assert reader.endianess is gguf.GGUFEndian.BIG
    assert kv(reader, "k") == (5, VT.UINT32)
    assert np.array_equal(reader.tensors[0].data, f32)
