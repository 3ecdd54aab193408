"""``fast_init`` gives the per-tensor records a cheaper ``__init__``: the record must
behave exactly as the dataclass it decorates, and classes it cannot build right are
refused."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field

import pytest

from aiogguf._fastinit import fast_init
from aiogguf._jobs import RangeSlot, TensorSlot
from aiogguf._records import (
    FileRange,
    LayerAssignment,
    MetadataEntry,
    TensorClass,
    TensorEntry,
    TensorInfo,
    TensorPlacement,
)
from aiogguf.io.ggml_types import ggml_type_by_name


@fast_init
@dataclass(frozen=True, slots=True)
class _Fast:
    name: str
    offset: int
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _Plain:
    name: str
    offset: int
    shape: tuple[int, ...]


def test_a_fast_record_behaves_as_the_plain_dataclass() -> None:
    fast = _Fast("a", 1, (2, 3))
    plain = _Plain("a", 1, (2, 3))
    assert (fast.name, fast.offset, fast.shape) == (plain.name, plain.offset, plain.shape)
    assert _Fast(name="a", shape=(2, 3), offset=1) == fast
    assert hash(_Fast("a", 1, (2, 3))) == hash(fast)
    assert fast != _Fast("a", 2, (2, 3))
    assert repr(fast) == repr(plain).replace("_Plain", "_Fast")
    assert dataclasses.replace(fast, offset=5) == _Fast("a", 5, (2, 3))
    assert dataclasses.astuple(fast) == dataclasses.astuple(plain)
    assert list(inspect.signature(_Fast).parameters) == ["name", "offset", "shape"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.name = "b"  # type: ignore[misc]
    with pytest.raises(TypeError):
        _Fast("a", 1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        _Fast("a", 1, (2,), 4)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        _Fast("a", 1, (2,), extra=4)  # type: ignore[call-arg]


def test_classes_it_cannot_build_right_are_refused() -> None:
    class NotADataclass:
        pass

    @dataclass(frozen=True)
    class NoSlots:
        name: str

    @dataclass(slots=True)
    class NotFrozen:
        name: str

    @dataclass(frozen=True, slots=True)
    class Defaulted:
        name: str
        items: tuple[int, ...] = field(default=())

    @dataclass(frozen=True, slots=True)
    class PostInit:
        name: str

        def __post_init__(self) -> None:
            pass

    for cls in (NotADataclass, NoSlots, NotFrozen, Defaulted, PostInit):
        with pytest.raises(TypeError, match="fast_init"):
            fast_init(cls)


def test_the_per_tensor_records_use_it() -> None:
    q4k = ggml_type_by_name("Q4_K")
    entry = TensorEntry(
        "blk.0.attn_q.weight", q4k, (256, 4), 0, 64, 576, 1024, 0, TensorClass.REPEATING
    )
    assert entry.end == 640
    assert TensorInfo("t", q4k, (256,), 0, 144, 256, 24).info_offset == 24
    for cls in (
        MetadataEntry,
        TensorInfo,
        TensorEntry,
        TensorPlacement,
        LayerAssignment,
        FileRange,
        TensorSlot,
        RangeSlot,
    ):
        assert cls.__init__.__module__ == cls.__module__
        assert all(name.startswith("_set_") for name in cls.__init__.__code__.co_names)
