"""The validate stage: ggml's per-type data checks, chunked checking, the collector."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import anyio
import numpy as np
import pytest
from conftest import reference_files
from corrupt import (
    checked_bit_mask,
    expected_bad,
    fill_ff,
    make_valid,
    plant_bf16_nan,
    plant_element,
    plant_scale,
)
from gguf_oracle import reference_reader
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiogguf._checks import TensorChecker, check_tensor, precheck
from aiogguf.errors import TensorFailure, TensorValidationError
from aiogguf.io.ggml_types import GGML_TYPES, GGMLType, ScaleKind, TypeKind, ggml_type
from aiogguf.io.ggml_types import ggml_type_by_name as by_name
from aiogguf.io.workers import LoadThreads
from aiogguf.stages.validate import ValidationCollector

VALID = [t for t in GGML_TYPES.values() if t.valid]
REMOVED = [t for t in GGML_TYPES.values() if not t.valid]
SUPPORTED = [t for t in VALID if t.validator_supported]
FLOATS = [t for t in VALID if t.kind is TypeKind.FLOAT]
CHECKED_FIELDS = [(t, f.name) for t in SUPPORTED if t.is_quantized for f in t.scales if f.checked]


def ids(t: GGMLType) -> str:
    return t.name


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20250220)


# --- per type ------------------------------------------------------------------------


@pytest.mark.parametrize("type_", SUPPORTED, ids=ids)
def test_valid_tensor_passes(type_: GGMLType, rng: np.random.Generator) -> None:
    data = make_valid(type_, 513, rng)
    assert check_tensor("t", type_, data) is None
    assert check_tensor("t", type_, data[:0]) is None  # an empty tensor is fine


@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize(
    ("type_", "field"), CHECKED_FIELDS, ids=[f"{t.name}.{f}" for t, f in CHECKED_FIELDS]
)
def test_bad_scale_is_reported_with_first_block_and_count(
    type_: GGMLType, field: str, value: str, rng: np.random.Generator
) -> None:
    data = make_valid(type_, 600, rng)
    assert plant_scale(data, type_, 433, value, field) == 433
    assert plant_scale(data, type_, 17, value, field) == 17
    plant_scale(data, type_, 599, value, field)
    failure = check_tensor("blk.0.w", type_, data)
    kind = next(f.kind for f in type_.scales if f.name == field)
    what = "invalid e8m0 value 255" if kind is ScaleKind.E8M0 else f"{value} value"
    assert failure == TensorFailure(
        "blk.0.w", type_.name, f"found {what} in scale '{field}'", 17, 3
    )
    # Slices smaller than the tensor carry index and count across slice boundaries.
    checker = TensorChecker("blk.0.w", type_, slice_bytes=7 * type_.block_bytes)
    checker.update(data)
    assert checker.finish() == failure


def test_d_is_named_before_m_and_a_block_counts_once(rng: np.random.Generator) -> None:
    q4_1 = by_name("Q4_1")
    data = make_valid(q4_1, 64, rng)
    plant_scale(data, q4_1, 9, "nan", "m")
    plant_scale(data, q4_1, 9, "inf", "d")
    plant_scale(data, q4_1, 30, "nan", "m")
    failure = check_tensor("t", q4_1, data)
    assert failure is not None
    assert (failure.problem, failure.first_index, failure.count) == (
        "found inf value in scale 'd'",
        9,
        2,
    )


@pytest.mark.parametrize(
    "type_", [t for t in VALID if t.is_quantized and t.validator_supported], ids=ids
)
def test_unchecked_fields_never_fire(type_: GGMLType, rng: np.random.Generator) -> None:
    # Every bit outside the checked scales set to one: payloads, sub-block scales,
    # Q8_K's bsums, NVFP4's UE4M3 scales, IQ1_M's low nibbles.
    data = make_valid(type_, 100, rng)
    keep = np.tile(checked_bit_mask(type_), 100)
    data[:] = (data & keep) | ~keep
    assert check_tensor("t", type_, data) is None


def test_q8_1_always_fails(rng: np.random.Generator) -> None:
    q8_1 = by_name("Q8_1")
    data = make_valid(q8_1, 8, rng)
    expected = TensorFailure("t", "Q8_1", "type not supported by validator", None, 0)
    assert check_tensor("t", q8_1, data) == expected
    data.reshape(8, 36)[:, 2:4] = 0xFF  # the unchecked s field: still the same report
    assert check_tensor("t", q8_1, data) == expected
    assert str(expected) == "tensor 't' (Q8_1): type not supported by validator"


@pytest.mark.parametrize("type_", REMOVED, ids=ids)
def test_removed_type_is_invalid(type_: GGMLType) -> None:
    failure = check_tensor("t", type_, np.zeros(64, np.uint8))
    assert failure == TensorFailure("t", type_.name, f"invalid type {type_.id}", None, 0)


@pytest.mark.parametrize("type_", [t for t in SUPPORTED if t.block_bytes > 1], ids=ids)
def test_size_not_a_multiple_fails_before_values(type_: GGMLType, rng: np.random.Generator) -> None:
    data = make_valid(type_, 4, rng)
    data[:] = 0xFF  # would be bad values; the size verdict wins, as in ggml
    short = data[:-1]
    problem = f"invalid size {short.size} for type {type_.name} (type size = {type_.block_bytes})"
    assert check_tensor("t", type_, short) == TensorFailure("t", type_.name, problem, None, 0)
    assert precheck("t", type_, short.size) == check_tensor("t", type_, short)


@pytest.mark.parametrize("type_", [t for t in FLOATS if t.name != "BF16"], ids=ids)
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_bad_element_first_index_and_class(
    type_: GGMLType, value: str, rng: np.random.Generator
) -> None:
    data = make_valid(type_, 5000, rng)
    assert plant_element(data, type_, 4321, value) == 4321
    assert plant_element(data, type_, 77, value) == 77
    plant_element(data, type_, 78, "nan" if value == "inf" else "inf")
    assert check_tensor("w", type_, data) == TensorFailure(
        "w", type_.name, f"found {value} value", 77, 3
    )


def test_f64_narrowing_like_ggml() -> None:
    f64 = by_name("F64")
    flt_max = float(np.finfo(np.float32).max)
    edge = 2.0**128 - 2.0**103  # the smallest magnitude that rounds to inf as float32
    values = np.array([1e-300, -flt_max, np.nextafter(edge, 0), 0.0, -edge, 1e39])
    failure = check_tensor("w", f64, values.view(np.uint8))
    assert failure == TensorFailure("w", "F64", "found inf value", 4, 2)
    assert expected_bad(values.view(np.uint8), f64) == (4, 2)


def test_bf16_counts_nans_and_infs(rng: np.random.Generator) -> None:
    bf16 = by_name("BF16")
    data = make_valid(bf16, 1000, rng)
    plant_element(data, bf16, 40, "inf")
    assert plant_bf16_nan(data, 900) == 40
    plant_bf16_nan(data, 901, payload=0x01)
    failure = check_tensor("emb", bf16, data)
    assert failure == TensorFailure(
        "emb", "BF16", "found 2 NaNs and 1 infinities in row of 1000 BF16 values", 40, 3
    )
    data = make_valid(bf16, 10, rng)
    plant_element(data, bf16, 3, "inf")
    assert check_tensor("emb", bf16, data) == TensorFailure(
        "emb", "BF16", "found 1 infinities in row of 10 BF16 values", 3, 1
    )


@pytest.mark.parametrize("name", ["I8", "I16", "I32", "I64", "NVFP4"])
def test_size_only_types_accept_any_bytes(name: str) -> None:
    type_ = by_name(name)
    assert check_tensor("t", type_, np.full(type_.block_bytes * 9, 0xFF, np.uint8)) is None


@pytest.mark.parametrize(
    ("name", "start", "nbytes"),
    [("Q4_K", 1000, 300), ("F16", 501, 3), ("MXFP4", 34, 1), ("BF16", 8, 2), ("F32", 6, 9)],
)
def test_ff_region_is_found(name: str, start: int, nbytes: int, rng: np.random.Generator) -> None:
    type_ = by_name(name)
    data = make_valid(type_, 2048 // type_.block_bytes * type_.block_elems, rng)
    first = fill_ff(data, type_, start, nbytes)
    assert first is not None
    failure = check_tensor("t", type_, data)
    assert failure is not None
    assert (failure.first_index, failure.count) == expected_bad(data, type_)
    assert failure.first_index == first


def test_checker_rejects_wrong_input() -> None:
    checker = TensorChecker("t", by_name("F32"))
    with pytest.raises(ValueError, match="1-D uint8"):
        checker.update(np.zeros(4, np.float32))
    checker.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        checker.update(np.zeros(4, np.uint8))


# --- the host screens (a fast pass that clears good data; never passes bad data) --------


@pytest.mark.parametrize("name", ["F16", "BF16"])
def test_screen_is_exact_on_every_16_bit_pattern(name: str) -> None:
    type_ = by_name(name)
    patterns = np.arange(1 << 16, dtype=np.uint16)
    exponent = 0x7C00 if name == "F16" else 0x7F80
    bad = (patterns & exponent) == exponent
    # One bad pattern among good ones, for every bad pattern; every good one alone.
    good_fill = np.zeros(8, np.uint16)
    for p in patterns[bad]:
        data = good_fill.copy()
        data[5] = p
        failure = check_tensor("w", type_, data.view(np.uint8))
        assert failure is not None, hex(p)
        assert failure.first_index == 5
    clean = patterns[~bad]
    assert check_tensor("w", type_, clean.view(np.uint8)) is None


def test_f32_screen_edges() -> None:
    f32 = by_name("F32")
    good = np.array([0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x80000000, 0x7F000000], np.uint32)
    assert check_tensor("w", f32, good.view(np.uint8)) is None
    for bad in (0x7F800000, 0xFF800000, 0x7FC00000, 0xFFFFFFFF, 0x7F800001):
        data = np.append(good, np.uint32(bad))
        failure = check_tensor("w", f32, data.view(np.uint8))
        assert failure is not None, hex(bad)
        assert failure.first_index == 5


FIELD_BYTES = {ScaleKind.FP16: 2, ScaleKind.F32: 4, ScaleKind.IQ1M: 8, ScaleKind.E8M0: 1}


@pytest.mark.parametrize("type_", list(dict.fromkeys(t for t, _ in CHECKED_FIELDS)), ids=ids)
def test_scale_screen_lets_no_bad_byte_through(type_: GGMLType, rng: np.random.Generator) -> None:
    # Every value of every byte of every checked field, in the last of 40 good blocks:
    # the verdict must be the full scan's (the oracle), whatever the screen makes of it.
    for field in [f for f in type_.scales if f.checked]:
        for k in range(FIELD_BYTES[field.kind]):
            data = make_valid(type_, 40, rng)
            blocks = data.reshape(40, type_.block_bytes)
            for value in range(256):
                blocks[39, field.offset + k] = value
                first, count = expected_bad(data, type_)
                failure = check_tensor("w", type_, data)
                assert (failure is None) == (count == 0), (field.name, k, value)
                if failure is not None:
                    assert (failure.first_index, failure.count) == (first, count)


# --- properties against numpy's float conversions -------------------------------------

ORACLE_TYPES = [t for t in SUPPORTED if t.kind is TypeKind.FLOAT or t.is_quantized]


@st.composite
def damaged_tensors(draw: st.DrawFn) -> tuple[GGMLType, np.ndarray]:
    type_ = draw(st.sampled_from(ORACLE_TYPES))
    units = draw(st.integers(0, 300 if type_.kind is TypeKind.FLOAT else 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    data = make_valid(type_, units, rng)
    if units:
        # Random bytes with many all-ones patterns, in a random share of the units.
        share = draw(st.sampled_from([0.0, 0.01, 0.2, 1.0]))
        unit = type_.block_bytes
        hit = np.repeat(rng.random(units) < share, unit)
        noise = rng.integers(0, 256, data.size, dtype=np.uint8)
        noise |= np.where(rng.random(data.size) < 0.5, 0x7C, 0).astype(np.uint8)
        data[hit] = noise[hit]
    return type_, data


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(damaged_tensors())
def test_property_matches_numpy_float_conversion(case: tuple[GGMLType, np.ndarray]) -> None:
    type_, data = case
    failure = check_tensor("t", type_, data)
    first, count = expected_bad(data, type_)
    if count == 0:
        assert failure is None
    else:
        assert failure is not None
        assert (failure.first_index, failure.count) == (first, count)


@settings(max_examples=150, deadline=None)
@given(damaged_tensors(), st.lists(st.integers(0, 10_000), max_size=6), st.integers(1, 9))
def test_property_chunked_equals_whole(
    case: tuple[GGMLType, np.ndarray], cuts: list[int], slice_units: int
) -> None:
    type_, data = case
    edges = sorted({0, data.size, *(c % (data.size + 1) for c in cuts)})
    checker = TensorChecker("t", type_, slice_bytes=slice_units * type_.block_bytes)
    for a, b in itertools.pairwise(edges):
        checker.update(data[a:b].copy())
    assert checker.nbytes == data.size
    assert checker.finish() == check_tensor("t", type_, data)


# --- llama.cpp's own files ------------------------------------------------------------


@pytest.mark.parametrize("file_name", reference_files())
def test_reference_tensors_pass(reference_dir: Path, file_name: str) -> None:
    reader = reference_reader(reference_dir / file_name)
    for tensor in reader.tensors:
        type_ = ggml_type(tensor.type_id)
        data = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(-1)
        assert data.size == tensor.n_bytes
        assert check_tensor(tensor.name, type_, data) is None, tensor.name


# --- the collector -------------------------------------------------------------------


def _bad_tensor(name: str, at: int, rng: np.random.Generator) -> tuple[GGMLType, np.ndarray]:
    type_ = by_name(name)
    data = make_valid(type_, 4096, rng)
    if type_.kind is TypeKind.FLOAT:
        plant_element(data, type_, at, "nan")
    else:
        plant_scale(data, type_, at)
    return type_, data


@pytest.mark.asyncio
async def test_collector_reports_every_bad_tensor(rng: np.random.Generator) -> None:
    bad = {"a.q4k": ("Q4_K", 4000), "b.f16": ("F16", 3), "c.mxfp4": ("MXFP4", 1234)}
    tensors = {name: _bad_tensor(t, at, rng) for name, (t, at) in bad.items()}
    tensors["good"] = (by_name("Q8_0"), make_valid(by_name("Q8_0"), 999, rng))
    tensors["bad.size"] = (by_name("Q6_K"), np.zeros(211, np.uint8))
    # Small calls: each check takes several thread hops, so they interleave.
    async with (
        LoadThreads(2) as threads,
        ValidationCollector(2, max_in_flight=2, call_bytes=4096, threads=threads) as collector,
    ):
        for name, (type_, data) in tensors.items():
            await collector.submit(name, type_, data)
    assert collector.submitted == 5
    assert [f.name for f in collector.failures] == ["a.q4k", "b.f16", "c.mxfp4", "bad.size"]
    message = str(TensorValidationError(collector.failures, "/models/m.gguf"))
    assert message.startswith("/models/m.gguf: found 4 tensors with invalid data:")
    for name, (_, at) in bad.items():
        assert f"tensor '{name}'" in message
        assert f"first at index {at}, 1 bad" in message
    assert "invalid size 211 for type Q6_K" in message
    assert "good" not in message


@pytest.mark.asyncio
async def test_collector_good_tensors_raise_nothing(rng: np.random.Generator) -> None:
    async with LoadThreads(1) as threads, ValidationCollector(1, threads=threads) as collector:
        for type_ in SUPPORTED[:6]:
            await collector.submit(type_.name, type_, make_valid(type_, 100, rng))
    assert collector.failures == ()
    assert collector.submitted == 6


@pytest.mark.asyncio
async def test_collector_backpressure_bounds_in_flight(
    rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    original = TensorChecker.update

    def held_update(self: TensorChecker, chunk: np.ndarray) -> None:
        assert release.wait(10), "never released"
        original(self, chunk)

    monkeypatch.setattr(TensorChecker, "update", held_update)
    f32 = by_name("F32")
    data = make_valid(f32, 1024, rng)
    async with (
        LoadThreads(1) as threads,
        ValidationCollector(1, max_in_flight=2, threads=threads) as collector,
    ):
        await collector.submit("t0", f32, data)
        await collector.submit("t1", f32, data)
        with anyio.move_on_after(0.2) as scope:
            await collector.submit("t2", f32, data)  # two in flight: this one waits
        assert scope.cancelled_caught
        assert collector.submitted == 2
        release.set()
        await collector.submit("t2", f32, data)
    assert collector.submitted == 3
    assert collector.bytes_checked == 3 * data.size
    assert collector.failures == ()


@pytest.mark.asyncio
async def test_cancel_inside_block_cancels_cleanly(rng: np.random.Generator) -> None:
    f16 = by_name("F16")
    data = make_valid(f16, 1 << 22, rng)  # 8 MiB, checked in 64 KiB thread calls
    before = threading.active_count()
    with anyio.CancelScope() as scope:
        async with (
            LoadThreads(2) as threads,
            ValidationCollector(2, call_bytes=1 << 16, threads=threads) as collector,
        ):
            for i in range(4):
                await collector.submit(f"t{i}", f16, data)
            scope.cancel()
            await anyio.sleep(1)
    assert scope.cancelled_caught
    assert collector.failures == ()
    with pytest.raises(RuntimeError, match="outside"):
        await collector.submit("late", f16, data)
    assert threading.active_count() <= before + 2  # idle pool threads at most


@pytest.mark.asyncio
async def test_collector_rejects_bad_arguments() -> None:
    async with LoadThreads(1) as threads:
        with pytest.raises(ValueError, match="workers"):
            ValidationCollector(workers=0, threads=threads)
        collector = ValidationCollector(threads=threads)
        with pytest.raises(RuntimeError, match="outside"):
            await collector.submit("t", by_name("F32"), np.zeros(4, np.uint8))
