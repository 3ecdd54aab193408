"""Tensor corruption helpers for tests, with an independent oracle.

``make_valid`` builds a well-formed random tensor of any type; the ``plant_*`` and
``fill_ff`` helpers damage it in place the way real files get damaged (format §6)
and return the index the validator must report first. ``expected_bad`` is the oracle:
it decodes the checked values with numpy's own float conversions (not the bit masks the
validator uses) and says which blocks/elements are non-finite.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from aiogguf.io.ggml_types import GGMLType, ScaleField, ScaleKind, TypeKind

__all__ = [
    "checked_bit_mask",
    "expected_bad",
    "fill_ff",
    "make_valid",
    "plant_bf16_nan",
    "plant_element",
    "plant_scale",
]

U8 = npt.NDArray[np.uint8]

# Bit patterns planted for "nan" and "inf" per scale encoding.
_FP16 = {"nan": 0x7E00, "inf": 0x7C00}
_F32 = {"nan": 0x7FC00000, "inf": 0x7F800000}
_F64 = {"nan": float("nan"), "inf": float("inf")}
_BF16 = {"nan": 0x7FC0, "inf": 0x7F80}


def _blocks(data: U8, type: GGMLType) -> U8:
    return data.reshape(-1, type.block_bytes)


def _checked(type: GGMLType) -> list[ScaleField]:
    return [f for f in type.scales if f.checked]


# --- building valid tensors ----------------------------------------------------------


def _finite_fp16_bits(rng: np.random.Generator, n: int) -> npt.NDArray[np.uint16]:
    values = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 4, n)).astype(np.float16)
    return values.view(np.uint16)


def _write_u16(blocks: U8, offset: int, bits: npt.NDArray[np.uint16]) -> None:
    blocks[:, offset] = bits & 0xFF
    blocks[:, offset + 1] = bits >> 8


def _write_iq1m(blocks: U8, offset: int, bits: npt.NDArray[np.uint16]) -> None:
    # The fp16's nibble k goes into the top nibble of byte offset + 2k + 1; the low
    # nibbles (sub-block scales) are left as they are.
    for k in range(4):
        column = blocks[:, offset + 2 * k + 1]
        nibble = ((bits >> (4 * k)) & 0xF).astype(np.uint8)
        blocks[:, offset + 2 * k + 1] = (column & 0x0F) | (nibble << 4)


def make_valid(type: GGMLType, n_units: int, rng: np.random.Generator) -> U8:
    """A random tensor of ``n_units`` blocks (elements for plain types) that is valid."""
    n = n_units
    if type.kind is TypeKind.FLOAT:
        values = rng.standard_normal(n).astype(np.float32)
        if type.name == "BF16":
            return (values.view(np.uint32) >> 16).astype("<u2").view(np.uint8)
        assert type.element_dtype is not None
        return values.astype(type.element_dtype).view(np.uint8)
    data = rng.integers(0, 256, n * type.block_bytes, dtype=np.uint8)
    blocks = _blocks(data, type)
    for field in _checked(type):
        if field.kind is ScaleKind.FP16:
            _write_u16(blocks, field.offset, _finite_fp16_bits(rng, n))
        elif field.kind is ScaleKind.IQ1M:
            _write_iq1m(blocks, field.offset, _finite_fp16_bits(rng, n))
        elif field.kind is ScaleKind.F32:
            f32 = rng.standard_normal(n).astype("<f4").view(np.uint8).reshape(n, 4)
            blocks[:, field.offset : field.offset + 4] = f32
        elif field.kind is ScaleKind.E8M0:
            blocks[:, field.offset] = rng.integers(0, 255, n, dtype=np.uint8)
    return data


def checked_bit_mask(type: GGMLType) -> U8:
    """Per byte of one block, the bits that belong to a checked scale field."""
    mask = np.zeros(type.block_bytes, dtype=np.uint8)
    for field in _checked(type):
        if field.kind is ScaleKind.FP16:
            mask[field.offset : field.offset + 2] = 0xFF
        elif field.kind is ScaleKind.F32:
            mask[field.offset : field.offset + 4] = 0xFF
        elif field.kind is ScaleKind.IQ1M:
            mask[field.offset + 1 : field.offset + 8 : 2] = 0xF0
        elif field.kind is ScaleKind.E8M0:
            mask[field.offset] = 0xFF
    return mask


# --- the oracle ----------------------------------------------------------------------


def _bad_scales(blocks: U8, field: ScaleField) -> npt.NDArray[np.bool_]:
    o = field.offset
    if field.kind is ScaleKind.FP16:
        return ~np.isfinite(np.ascontiguousarray(blocks[:, o : o + 2]).view("<f2")[:, 0])
    if field.kind is ScaleKind.F32:
        return ~np.isfinite(np.ascontiguousarray(blocks[:, o : o + 4]).view("<f4")[:, 0])
    if field.kind is ScaleKind.IQ1M:
        words = np.ascontiguousarray(blocks[:, o : o + 8]).view("<u2")
        bits = sum((words[:, k] >> 12) << (4 * k) for k in range(4))
        return ~np.isfinite(np.asarray(bits, dtype=np.uint16).view(np.float16))
    if field.kind is ScaleKind.E8M0:
        return blocks[:, o] == 0xFF
    return np.zeros(blocks.shape[0], dtype=bool)


def _bad_elements(data: U8, type: GGMLType) -> npt.NDArray[np.bool_]:
    if type.name == "BF16":
        return ~np.isfinite((data.view("<u2").astype(np.uint32) << 16).view(np.float32))
    if type.name == "F64":
        with np.errstate(over="ignore", invalid="ignore"):
            return ~np.isfinite(data.view("<f8").astype(np.float32))
    assert type.element_dtype is not None
    return ~np.isfinite(data.view(type.element_dtype))


def expected_bad(data: U8, type: GGMLType) -> tuple[int | None, int]:
    """(first bad block or element, how many) by numpy's float conversions.

    Only for valid, validator-supported types with whole blocks.
    """
    if type.kind is TypeKind.FLOAT:
        bad = _bad_elements(data, type)
    elif type.kind is TypeKind.QUANT:
        blocks = _blocks(data, type)
        bad = np.zeros(blocks.shape[0], dtype=bool)
        for field in _checked(type):
            bad |= _bad_scales(blocks, field)
    else:
        return None, 0
    count = int(np.count_nonzero(bad))
    return (int(np.argmax(bad)) if count else None), count


# --- corruption ----------------------------------------------------------------------


def plant_scale(
    data: U8, type: GGMLType, block: int, value: str = "nan", field: str | None = None
) -> int | None:
    """Make scale ``field`` (default: the first checked one) of ``block`` a NaN or Inf.

    ``value`` is "nan" or "inf" (ignored for e8m0, which is set to 0xFF).
    Returns the first bad block the validator must report.
    """
    chosen = next(f for f in _checked(type) if field is None or f.name == field)
    row = _blocks(data, type)[block : block + 1]
    if chosen.kind is ScaleKind.FP16:
        _write_u16(row, chosen.offset, np.array([_FP16[value] | 0x8000 * (block % 2)], "<u2"))
    elif chosen.kind is ScaleKind.IQ1M:
        _write_iq1m(row, chosen.offset, np.array([_FP16[value]], "<u2"))
    elif chosen.kind is ScaleKind.F32:
        bits = np.array([_F32[value]], "<u4").view(np.uint8)
        row[0, chosen.offset : chosen.offset + 4] = bits
    elif chosen.kind is ScaleKind.E8M0:
        row[0, chosen.offset] = 0xFF
    else:
        raise ValueError(f"{type.name}.{chosen.name}: not a checked scale")
    return expected_bad(data, type)[0]


def plant_element(data: U8, type: GGMLType, index: int, value: str = "inf") -> int | None:
    """Make element ``index`` of a plain float tensor a NaN or Inf (either sign).

    Returns the first bad element the validator must report.
    """
    if type.name == "BF16":
        data.view("<u2")[index] = _BF16[value] | 0x8000 * (index % 2)
    elif type.name == "F64":
        data.view("<f8")[index] = _F64[value] * (-1) ** index
    elif type.name == "F32":
        data.view("<u4")[index] = _F32[value] | 0x80000000 * (index % 2)
    elif type.name == "F16":
        data.view("<u2")[index] = _FP16[value] | 0x8000 * (index % 2)
    else:
        raise ValueError(f"{type.name}: not a float type")
    return expected_bad(data, type)[0]


def plant_bf16_nan(data: U8, index: int, payload: int = 0x40) -> int | None:
    """Make BF16 element ``index`` a NaN with mantissa ``payload`` (1..0x7F)."""
    from aiogguf.io.ggml_types import ggml_type_by_name

    data.view("<u2")[index] = 0x7F80 | (payload & 0x7F or 1)
    return expected_bad(data, ggml_type_by_name("BF16"))[0]


def fill_ff(data: U8, type: GGMLType, start: int, nbytes: int) -> int | None:
    """Fill bytes ``[start, start + nbytes)`` with 0xFF (a failed flash write).

    Returns the first bad block or element the validator must report (None if the
    region touched no checked bits).
    """
    data[start : start + nbytes] = 0xFF
    return expected_bad(data, type)[0]
