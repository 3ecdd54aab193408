"""The ggml type table against gguf-py's (the oracle), with the two known differences."""

from __future__ import annotations

import gguf
import pytest

from aiogguf.io.ggml_types import GGML_TYPE_COUNT, GGML_TYPES, TypeKind, ggml_type_by_name

REMOVED = {4, 5, 31, 32, 33, 36, 37, 38}
# gguf-py 0.19 says Q8_1 blocks are 40 bytes; ggml's C struct (what is on disk) is 36.
Q8_1_C_BYTES = 36
# gguf-py 0.19 does not know Q2_0 (id 42) yet.
NOT_IN_GGUF_PY = {42}


def test_ids_are_dense_and_complete() -> None:
    assert sorted(GGML_TYPES) == list(range(GGML_TYPE_COUNT))
    assert {i for i, t in GGML_TYPES.items() if not t.valid} == REMOVED


@pytest.mark.parametrize("type_id", sorted(set(range(GGML_TYPE_COUNT)) - REMOVED))
def test_valid_type_matches_gguf_py(type_id: int) -> None:
    ours = GGML_TYPES[type_id]
    assert ggml_type_by_name(ours.name) is ours
    if type_id in NOT_IN_GGUF_PY:
        assert ours.name not in gguf.GGMLQuantizationType.__members__
        assert (ours.block_elems, ours.block_bytes) == (64, 18)
        return
    theirs = gguf.GGMLQuantizationType(type_id)
    assert theirs.name == ours.name
    blck, tsize = gguf.GGML_QUANT_SIZES[theirs]
    assert ours.block_elems == blck
    if ours.name == "Q8_1":
        assert (tsize, ours.block_bytes) == (40, Q8_1_C_BYTES)
    else:
        assert ours.block_bytes == tsize


@pytest.mark.parametrize("type_id", sorted(REMOVED))
def test_removed_ids_are_unknown_to_gguf_py(type_id: int) -> None:
    ours = GGML_TYPES[type_id]
    assert ours.kind is TypeKind.INVALID
    assert (ours.block_elems, ours.block_bytes) == (0, 0)
    with pytest.raises(ValueError, match=str(type_id)):
        gguf.GGMLQuantizationType(type_id)


def test_gguf_py_has_nothing_we_lack() -> None:
    assert {t.value for t in gguf.GGMLQuantizationType} <= set(GGML_TYPES)
