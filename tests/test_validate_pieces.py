"""PieceCheck: pieces in any order, from several threads, give check_tensor's verdict."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
from corrupt import expected_bad, fill_ff, make_valid, plant_bf16_nan, plant_element, plant_scale
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiogguf._checks import PieceCheck, check_tensor
from aiogguf.io.ggml_types import GGML_TYPES, GGMLType, TypeKind
from aiogguf.io.ggml_types import ggml_type_by_name as by_name

VALID = [t for t in GGML_TYPES.values() if t.valid]
REMOVED = [t for t in GGML_TYPES.values() if not t.valid]
QUICK = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def damaged_tensors(draw: st.DrawFn) -> tuple[GGMLType, np.ndarray]:
    """Any valid type (Q8_1, integer types and NVFP4 included), valid data with planted
    bad scales or elements, a 0xFF run, noise, and now and then a size that is not whole."""
    type_ = draw(st.sampled_from(VALID))
    floats = type_.kind is TypeKind.FLOAT
    units = draw(st.integers(0, 400 if floats else 60))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    data = make_valid(type_, units, rng)
    checked = [f.name for f in type_.scales if f.checked]
    for _ in range(draw(st.integers(0, 4)) if units else 0):
        at = int(rng.integers(units))
        value = str(rng.choice(["nan", "inf"]))
        if floats:
            if type_.name == "BF16" and rng.random() < 0.5:
                plant_bf16_nan(data, at, int(rng.integers(1, 0x80)))
            else:
                plant_element(data, type_, at, value)
        elif type_.is_quantized and checked:
            plant_scale(data, type_, at, value, str(rng.choice(checked)))
    if units and draw(st.booleans()):
        start = int(rng.integers(data.size))
        fill_ff(data, type_, start, int(rng.integers(1, 3 * type_.block_bytes + 1)))
    if units and draw(st.integers(0, 9)) == 0:
        data = data[: data.size - int(rng.integers(1, type_.block_bytes + 1))].copy()
    return type_, data


def partition(size: int, cuts: list[int], tiny: list[int]) -> list[tuple[int, int]]:
    """Pieces [a, b) that tile ``size`` bytes; ``tiny`` adds cuts a byte or two apart."""
    points = {0, size, *(c % (size + 1) for c in cuts)}
    points |= {min(size, c % (size + 1) + d) for c in tiny for d in (1, 2)}
    return list(itertools.pairwise(sorted(points)))


def feed(check: PieceCheck, data: np.ndarray, pieces: list[tuple[int, int]]) -> None:
    for a, b in pieces:
        check.check_piece(data[a:b], a)


@QUICK
@given(
    damaged_tensors(),
    st.lists(st.integers(0, 100_000), max_size=12),
    st.lists(st.integers(0, 100_000), max_size=4),
    st.randoms(use_true_random=False),
    st.floats(0.0, 1.0),
)
def test_property_pieces_in_any_order_equal_whole(
    case: tuple[GGMLType, np.ndarray],
    cuts: list[int],
    tiny: list[int],
    random: object,
    keep: float,
) -> None:
    type_, data = case
    pieces = partition(data.size, cuts, tiny)
    random.shuffle(pieces)  # type: ignore[attr-defined]
    # Some pieces are never fed: finish() must check their units itself.
    fed = pieces[: round(len(pieces) * keep)] if keep < 0.9 else pieces
    check = PieceCheck("blk.3.w", type_, data.size)
    feed(check, data, fed)
    assert check.finish(data) == check_tensor("blk.3.w", type_, data)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    damaged_tensors(),
    st.lists(st.integers(0, 100_000), min_size=4, max_size=40),
    st.integers(2, 4),
    st.randoms(use_true_random=False),
)
def test_property_pieces_from_threads_equal_whole(
    case: tuple[GGMLType, np.ndarray], cuts: list[int], threads: int, random: object
) -> None:
    type_, data = case
    pieces = partition(data.size, cuts, [])
    random.shuffle(pieces)  # type: ignore[attr-defined]
    check = PieceCheck("t", type_, data.size)
    start = threading.Barrier(threads)
    errors: list[BaseException] = []

    def worker(mine: list[tuple[int, int]]) -> None:
        try:
            start.wait()
            feed(check, data, mine)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    workers = [threading.Thread(target=worker, args=(pieces[k::threads],)) for k in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    assert errors == []
    assert check.finish(data) == check_tensor("t", type_, data)


@QUICK
@given(damaged_tensors(), st.lists(st.tuples(st.integers(0, 10**5), st.integers(0, 10**4))))
def test_property_overlapping_pieces_count_each_unit_once(
    case: tuple[GGMLType, np.ndarray], spans: list[tuple[int, int]]
) -> None:
    type_, data = case
    check = PieceCheck("t", type_, data.size)
    for start, length in spans:
        a = start % (data.size + 1)
        b = min(data.size, a + length)
        check.check_piece(data[a:b], a)
        check.check_piece(data[a:b], a)  # the very same piece twice
    assert check.finish(data) == check_tensor("t", type_, data)


@pytest.mark.parametrize("name", ["Q4_K", "IQ1_M", "MXFP4", "Q8_K", "F16", "BF16", "F64"])
def test_every_unit_counted_once(name: str) -> None:
    type_ = by_name(name)
    data = make_valid(type_, 300, np.random.default_rng(1))
    fill_ff(data, type_, 0, data.size)  # every unit bad
    first, count = expected_bad(data, type_)
    assert (first, count) == (0, 300)
    check = PieceCheck("t", type_, data.size)
    unit = type_.block_bytes
    # Mid-block edges, an overlap, a repeat, and the last piece first.
    for a, b in [(250 * unit + 1, data.size), (5, 100 * unit + 3), (50 * unit, 260 * unit)] * 2:
        check.check_piece(data[a:b], a)
    failure = check.finish(data)
    assert failure is not None
    assert (failure.first_index, failure.count) == (0, 300)
    assert failure == check_tensor("t", type_, data)


@pytest.mark.parametrize("type_", VALID, ids=lambda t: t.name)
def test_no_piece_then_finish_is_the_full_check(type_: GGMLType) -> None:
    rng = np.random.default_rng(7)
    data = make_valid(type_, 97, rng)
    if type_.kind is TypeKind.FLOAT:
        plant_element(data, type_, 60)
        plant_element(data, type_, 3, "nan")
    elif [f for f in type_.scales if f.checked]:
        plant_scale(data, type_, 60)
        plant_scale(data, type_, 3, "inf")
    assert PieceCheck("t", type_, data.size).finish(data) == check_tensor("t", type_, data)


def test_first_index_is_the_minimum_over_out_of_order_pieces() -> None:
    type_ = by_name("Q4_K")
    data = make_valid(type_, 100, np.random.default_rng(3))
    plant_scale(data, type_, 80, "inf", "dmin")
    plant_scale(data, type_, 20, "nan", "d")
    check = PieceCheck("t", type_, data.size)
    half = 50 * type_.block_bytes + 7  # mid-block cut
    check.check_piece(data[half:], half)  # the later bad block is found first
    check.check_piece(data[:half], 0)
    failure = check.finish(data)
    assert failure is not None
    assert (failure.problem, failure.first_index, failure.count) == (
        "found nan value in scale 'd'",
        20,
        2,
    )


def test_bf16_wording_and_nan_count_across_pieces() -> None:
    type_ = by_name("BF16")
    data = make_valid(type_, 64, np.random.default_rng(4))
    plant_bf16_nan(data, 40)
    plant_element(data, type_, 9, "inf")
    plant_element(data, type_, 50, "inf")
    check = PieceCheck("t", type_, data.size)
    check.check_piece(data[81:], 81)  # cuts element 40 in half: finish() checks it
    check.check_piece(data[:81], 0)
    failure = check.finish(data)
    assert failure is not None
    assert failure.problem == "found 1 NaNs and 2 infinities in row of 64 BF16 values"
    assert (failure.first_index, failure.count) == (9, 3)


@pytest.mark.parametrize("type_", [*REMOVED[:2], by_name("Q8_1")], ids=lambda t: t.name)
def test_type_failures_match(type_: GGMLType) -> None:
    data = np.full(64, 0xFF, np.uint8)
    check = PieceCheck("t", type_, data.size)
    check.check_piece(data[10:40], 10)
    assert check.finish(data) == check_tensor("t", type_, data)


def test_bad_size_matches_and_skips_the_scan() -> None:
    type_ = by_name("Q8_0")
    data = np.full(type_.block_bytes * 3 + 5, 0xFF, np.uint8)
    check = PieceCheck("t", type_, data.size)
    check.check_piece(data, 0)
    failure = check.finish(data)
    assert failure == check_tensor("t", type_, data)
    assert failure is not None
    assert failure.problem.startswith("invalid size")


def test_rejects_wrong_input() -> None:
    check = PieceCheck("t", by_name("F32"), 16)
    with pytest.raises(ValueError, match="1-D uint8"):
        check.check_piece(np.zeros(4, np.float32), 0)
    with pytest.raises(ValueError, match=r"piece \[12, 20\) lies outside its 16 bytes"):
        check.check_piece(np.zeros(8, np.uint8), 12)
    with pytest.raises(ValueError, match="outside"):
        check.check_piece(np.zeros(1, np.uint8), -1)
    with pytest.raises(ValueError, match="got 8 bytes, expected 16"):
        check.finish(np.zeros(8, np.uint8))
    with pytest.raises(ValueError, match="negative size"):
        PieceCheck("t", by_name("F32"), -4)
    assert check.finish(np.zeros(16, np.uint8)) is None
    with pytest.raises(RuntimeError, match="after finish"):
        check.check_piece(np.zeros(4, np.uint8), 0)
