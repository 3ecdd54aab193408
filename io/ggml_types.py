"""The ggml tensor type table, as data (format §4).

Schema of ``GGML_TYPES``: type id → ``GGMLType`` with the block geometry and the
byte offsets of the scale fields that validation checks (format §4.2, §5.2).
Removed ids (4, 5, 31–33, 36–38) are present with ``valid=False`` and zero sizes,
so that an error can name them instead of calling them unknown.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "GGML_TYPES",
    "GGML_TYPE_COUNT",
    "GGMLType",
    "ScaleField",
    "ScaleKind",
    "TypeKind",
    "ggml_type",
    "ggml_type_by_name",
]

GGML_TYPE_COUNT = 43


class TypeKind(StrEnum):
    """What a ggml type's elements are: floats, integers or quantized blocks."""

    FLOAT = "float"
    INT = "int"
    QUANT = "quant"
    INVALID = "invalid"


class ScaleKind(StrEnum):
    """How a quantized type stores its block scales."""

    FP16 = "fp16"
    F32 = "f32"
    E8M0 = "e8m0"
    UE4M3 = "ue4m3"
    # IQ1_M's fp16 super-scale, spread over the top nibbles of four u16 words.
    IQ1M = "iq1m"


@dataclass(frozen=True, slots=True)
class ScaleField:
    """A scale inside a block: byte offset, encoding, and whether validation checks it."""

    name: str
    offset: int
    kind: ScaleKind
    checked: bool = True


@dataclass(frozen=True, slots=True)
class GGMLType:
    """One ggml type: ``block_elems`` elements stored in ``block_bytes`` bytes."""

    id: int
    name: str
    block_elems: int
    block_bytes: int
    kind: TypeKind
    scales: tuple[ScaleField, ...] = ()
    # numpy dtype of one element for plain types (little-endian); None for blocks.
    element_dtype: str | None = None
    # False where ggml's validator has no branch for the type (Q8_1).
    validator_supported: bool = True

    @property
    def valid(self) -> bool:
        return self.kind is not TypeKind.INVALID

    @property
    def is_quantized(self) -> bool:
        return self.kind is TypeKind.QUANT

    def nbytes(self, n_elements: int) -> int:
        """Bytes of ``n_elements`` elements stored contiguously (a whole number of blocks)."""
        return n_elements // self.block_elems * self.block_bytes


def _d(offset: int = 0) -> tuple[ScaleField, ...]:
    return (ScaleField("d", offset, ScaleKind.FP16),)


def _dm(d: int, m: int, m_name: str) -> tuple[ScaleField, ...]:
    return (ScaleField("d", d, ScaleKind.FP16), ScaleField(m_name, m, ScaleKind.FP16))


_F, _I, _Q, _X = TypeKind.FLOAT, TypeKind.INT, TypeKind.QUANT, TypeKind.INVALID

_TABLE: tuple[GGMLType, ...] = (
    GGMLType(0, "F32", 1, 4, _F, element_dtype="<f4"),
    GGMLType(1, "F16", 1, 2, _F, element_dtype="<f2"),
    GGMLType(2, "Q4_0", 32, 18, _Q, _d()),
    GGMLType(3, "Q4_1", 32, 20, _Q, _dm(0, 2, "m")),
    GGMLType(4, "Q4_2", 0, 0, _X),
    GGMLType(5, "Q4_3", 0, 0, _X),
    GGMLType(6, "Q5_0", 32, 22, _Q, _d()),
    GGMLType(7, "Q5_1", 32, 24, _Q, _dm(0, 2, "m")),
    GGMLType(8, "Q8_0", 32, 34, _Q, _d()),
    GGMLType(
        9,
        "Q8_1",
        32,
        36,
        _Q,
        (ScaleField("d", 0, ScaleKind.FP16), ScaleField("s", 2, ScaleKind.FP16, checked=False)),
        validator_supported=False,
    ),
    GGMLType(10, "Q2_K", 256, 84, _Q, _dm(80, 82, "dmin")),
    GGMLType(11, "Q3_K", 256, 110, _Q, _d(108)),
    GGMLType(12, "Q4_K", 256, 144, _Q, _dm(0, 2, "dmin")),
    GGMLType(13, "Q5_K", 256, 176, _Q, _dm(0, 2, "dmin")),
    GGMLType(14, "Q6_K", 256, 210, _Q, _d(208)),
    GGMLType(15, "Q8_K", 256, 292, _Q, (ScaleField("d", 0, ScaleKind.F32),)),
    GGMLType(16, "IQ2_XXS", 256, 66, _Q, _d()),
    GGMLType(17, "IQ2_XS", 256, 74, _Q, _d()),
    GGMLType(18, "IQ3_XXS", 256, 98, _Q, _d()),
    GGMLType(19, "IQ1_S", 256, 50, _Q, _d()),
    GGMLType(20, "IQ4_NL", 32, 18, _Q, _d()),
    GGMLType(21, "IQ3_S", 256, 110, _Q, _d()),
    GGMLType(22, "IQ2_S", 256, 82, _Q, _d()),
    GGMLType(23, "IQ4_XS", 256, 136, _Q, _d()),
    GGMLType(24, "I8", 1, 1, _I, element_dtype="<i1"),
    GGMLType(25, "I16", 1, 2, _I, element_dtype="<i2"),
    GGMLType(26, "I32", 1, 4, _I, element_dtype="<i4"),
    GGMLType(27, "I64", 1, 8, _I, element_dtype="<i8"),
    GGMLType(28, "F64", 1, 8, _F, element_dtype="<f8"),
    GGMLType(29, "IQ1_M", 256, 56, _Q, (ScaleField("scale", 48, ScaleKind.IQ1M),)),
    # numpy has no bfloat16: BF16 elements are exposed as their raw uint16 bits.
    GGMLType(30, "BF16", 1, 2, _F, element_dtype="<u2"),
    GGMLType(31, "Q4_0_4_4", 0, 0, _X),
    GGMLType(32, "Q4_0_4_8", 0, 0, _X),
    GGMLType(33, "Q4_0_8_8", 0, 0, _X),
    GGMLType(34, "TQ1_0", 256, 54, _Q, _d(52)),
    GGMLType(35, "TQ2_0", 256, 66, _Q, _d(64)),
    GGMLType(36, "IQ4_NL_4_4", 0, 0, _X),
    GGMLType(37, "IQ4_NL_4_8", 0, 0, _X),
    GGMLType(38, "IQ4_NL_8_8", 0, 0, _X),
    GGMLType(39, "MXFP4", 32, 17, _Q, (ScaleField("e", 0, ScaleKind.E8M0),)),
    GGMLType(
        40,
        "NVFP4",
        64,
        36,
        _Q,
        tuple(ScaleField(f"d{i}", i, ScaleKind.UE4M3, checked=False) for i in range(4)),
    ),
    GGMLType(41, "Q1_0", 128, 18, _Q, _d()),
    GGMLType(42, "Q2_0", 64, 18, _Q, _d()),
)

GGML_TYPES: dict[int, GGMLType] = {t.id: t for t in _TABLE}
_BY_NAME: dict[str, GGMLType] = {t.name: t for t in _TABLE}
assert len(GGML_TYPES) == GGML_TYPE_COUNT


def ggml_type(type_id: int) -> GGMLType:
    """The table row of ``type_id``; ``KeyError`` for ids outside ``[0, 43)``."""
    return GGML_TYPES[type_id]


def ggml_type_by_name(name: str) -> GGMLType:
    """The table row named ``name`` (``"Q4_K"``; case-insensitive); ``KeyError`` if none."""
    return _BY_NAME[name.upper()]
