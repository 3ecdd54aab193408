"""Synthetic llama-shaped GGUF models for the demo, the tests and the benchmarks.

Files are written with llama.cpp's own Python writer (``gguf.GGUFWriter``) for the
header, metadata and tensor infos; the tensor data is generated and streamed one chunk
at a time, so a multi-GiB model never sits in memory.

The data is random, but *valid*: every scale field that ggml's validator checks holds a
small finite value, and float tensors hold finite values only. ``Corruption`` records put
exactly one kind of damage at an exact place, for the validation tests.

Type presets (``types=``): ``"mixed"`` (Q4_K_M-like: F32 norms, F16 token_embd, Q4_K /
Q8_0 matrices, Q6_K output), ``"float"`` (F32/F16/BF16 only: the default for big-endian
files, whose quantized tensors aiogguf refuses to load), ``"f32"``, ``"f16"``, ``"bf16"``,
``"q8_0"``, ``"q4_0"``, ``"all-types"`` (every valid ggml type at least once), or any ggml
type name (``"Q5_K"``: every matrix of that type, norms F32).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, BinaryIO, Literal, cast

import gguf
import numpy as np
import numpy.typing as npt

from aiogguf._units import parse_size
from aiogguf.io.ggml_types import GGML_TYPES, GGMLType, ScaleField, ScaleKind, ggml_type_by_name

__all__ = [
    "PRESET_NAMES",
    "Corruption",
    "CorruptionKind",
    "SynthModel",
    "SynthTensor",
    "write_synthetic_model",
]

GiB = 1024**3
MiB = 1024**2

# Bytes generated and stamped per write call; big enough for full-speed writes, small
# enough that memory stays flat whatever the model size.
_CHUNK_BYTES = 8 * MiB
# Random bytes are made once per model (numpy's generator is far slower than a copy) and
# each chunk is a window at a random offset into this pool, which copies at memory speed.
_POOL_BYTES = 16 * MiB
_HEAD_DIM = 128
_FF_RATIO = 2.6875  # llama-7B's 11008 / 4096

# Roles of the tensors in one llama model, in file order within a layer.
_LAYER_ROLES: tuple[tuple[str, str], ...] = (
    ("attn_norm", "norm"),
    ("attn_q", "attn_q"),
    ("attn_k", "attn_k"),
    ("attn_v", "attn_v"),
    ("attn_output", "attn_output"),
    ("ffn_norm", "norm"),
    ("ffn_gate", "ffn_gate"),
    ("ffn_up", "ffn_up"),
    ("ffn_down", "ffn_down"),
)
# Matrix slots per layer (everything but the two norms): all-types fills these.
_MATRICES_PER_LAYER = 7


@dataclass(frozen=True, slots=True)
class _Preset:
    """Type name per tensor role, and the ``general.file_type`` it stands for."""

    roles: dict[str, str]
    file_type: int


def _uniform(
    matrix: str, file_type: int, *, embd: str | None = None, out: str | None = None
) -> _Preset:
    roles = dict.fromkeys(
        ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"), matrix
    )
    roles |= {"norm": "F32", "token_embd": embd or matrix, "output": out or matrix}
    return _Preset(roles, file_type)


_FT = gguf.LlamaFileType
# Presets as data: role -> ggml type name. "all-types" is built per model (see _plan).
_PRESETS: dict[str, _Preset] = {
    "mixed": _Preset(
        {
            "norm": "F32",
            "token_embd": "F16",
            "attn_q": "Q4_K",
            "attn_k": "Q4_K",
            "attn_v": "Q8_0",
            "attn_output": "Q4_K",
            "ffn_gate": "Q4_K",
            "ffn_up": "Q4_K",
            "ffn_down": "Q8_0",
            "output": "Q6_K",
        },
        int(_FT.MOSTLY_Q4_K_M),
    ),
    "float": _Preset(
        {
            "norm": "F32",
            "token_embd": "F16",
            "attn_q": "BF16",
            "attn_k": "BF16",
            "attn_v": "BF16",
            "attn_output": "BF16",
            "ffn_gate": "F16",
            "ffn_up": "F16",
            "ffn_down": "F16",
            "output": "F32",
        },
        int(_FT.MOSTLY_F16),
    ),
    "f32": _uniform("F32", int(_FT.ALL_F32)),
    "f16": _uniform("F16", int(_FT.MOSTLY_F16)),
    "bf16": _uniform("BF16", int(_FT.MOSTLY_BF16)),
    "q8_0": _uniform("Q8_0", int(_FT.MOSTLY_Q8_0)),
    "q4_0": _uniform("Q4_0", int(_FT.MOSTLY_Q4_0), out="Q6_K"),
}
_ALL_TYPES = "all-types"
# What ``types=`` accepts besides a ggml type name (for CLI choices and messages).
PRESET_NAMES: tuple[str, ...] = (*_PRESETS, _ALL_TYPES)


class CorruptionKind(StrEnum):
    """What a ``Corruption`` does to its tensor."""

    # The first checked scale field of block ``index`` becomes NaN (fp16 0x7E00, f32
    # 0x7FC00000, e8m0 0xFF, IQ1_M's spread scale 0x7E00).
    NAN_SCALE = "nan_scale"
    # Element ``index`` of an F32/F16/BF16/F64 tensor becomes +Inf.
    INF_ELEMENT = "inf_element"
    # ``length`` bytes from the start of block ``index`` (element, for plain types) become 0xFF.
    FF_FILL = "ff_fill"
    # Element ``index`` of a BF16 tensor becomes the quiet NaN 0x7FC0.
    BF16_NAN = "bf16_nan"


@dataclass(frozen=True, slots=True)
class Corruption:
    """Damage to tensor ``tensor`` at block/element ``index`` (see ``CorruptionKind``)."""

    tensor: str
    # Stored as the enum; the plain strings are accepted for convenience.
    kind: CorruptionKind | Literal["nan_scale", "inf_element", "ff_fill", "bf16_nan"]
    index: int
    length: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", CorruptionKind(self.kind))
        if self.index < 0 or self.length < 1:
            raise ValueError(f"corruption of '{self.tensor}': index must be >= 0, length >= 1")


@dataclass(frozen=True, slots=True)
class SynthTensor:
    """One tensor as written: ggml shape (ne[0] first), type, and where its bytes are."""

    name: str
    type_id: int
    shape: tuple[int, ...]
    nbytes: int
    shard: int
    # Relative to the shard's data section, as in the tensor info.
    offset: int
    # Absolute position of the first byte in the shard file.
    file_offset: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.type_id].name

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class SynthModel:
    """A synthetic model on disk: its files (shard order), hyperparameters and tensors."""

    paths: tuple[Path, ...]
    preset: str
    seed: int
    big_endian: bool
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_vocab: int
    n_tensors: int
    tensor_bytes: int
    file_bytes: int
    tensors: tuple[SynthTensor, ...]
    corruptions: tuple[Corruption, ...] = ()

    @property
    def path(self) -> Path:
        """The file to open: the only file, or the first shard."""
        return self.paths[0]

    def tensor(self, name: str) -> SynthTensor:
        """The tensor called ``name``; ``KeyError`` if there is none."""
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def tensors_of_type(self, type_name: str) -> tuple[SynthTensor, ...]:
        """Every tensor of the ggml type ``type_name`` (``"Q4_K"``), in file order."""
        type_id = ggml_type_by_name(type_name).id
        return tuple(t for t in self.tensors if t.type_id == type_id)


# ---------------------------------------------------------------------------------------
# Planning: names, shapes and types, chosen so the tensor bytes come close to the target.


@dataclass(frozen=True, slots=True)
class _Spec:
    name: str
    type_id: int
    shape: tuple[int, ...]  # ggml order

    @property
    def nbytes(self) -> int:
        return GGML_TYPES[self.type_id].nbytes(math.prod(self.shape))


@dataclass(frozen=True, slots=True)
class _Plan:
    preset: str
    file_type: int
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_vocab: int
    specs: tuple[_Spec, ...]
    shard_starts: tuple[int, ...]  # index of each shard's first tensor

    @property
    def tensor_bytes(self) -> int:
        return sum(s.nbytes for s in self.specs)


def _all_types(include_q8_1: bool, include_q2_0: bool) -> list[int]:
    skip = {"Q8_1"} - ({"Q8_1"} if include_q8_1 else set())
    skip |= set() if include_q2_0 else {"Q2_0"}
    return [t.id for t in GGML_TYPES.values() if t.valid and t.name not in skip]


def _heads(n_embd: int) -> tuple[int, int]:
    head_dim = _HEAD_DIM if n_embd >= 1024 else 64
    n_head = n_embd // head_dim
    # Grouped-query attention as in llama-2/3; fall back to plain MHA when it does not divide.
    return n_head, n_head // 4 if n_head % 4 == 0 else n_head


def _layout(
    n_layer: int, n_embd: int, n_ff: int, n_vocab: int, role_types: dict[str, int], slots: list[int]
) -> list[_Spec]:
    """The llama tensor list in converter order. ``slots``: per-matrix types (all-types)."""
    n_head, n_head_kv = _heads(n_embd)
    n_embd_kv = n_embd // n_head * n_head_kv
    shapes = {
        "attn_norm": (n_embd,),
        "attn_q": (n_embd, n_embd),
        "attn_k": (n_embd, n_embd_kv),
        "attn_v": (n_embd, n_embd_kv),
        "attn_output": (n_embd, n_embd),
        "ffn_norm": (n_embd,),
        "ffn_gate": (n_embd, n_ff),
        "ffn_up": (n_embd, n_ff),
        "ffn_down": (n_ff, n_embd),
    }
    slot_iter = iter(slots)

    def type_of(role: str) -> int:
        if role != "norm" and slots:
            return next(slot_iter, role_types[role])
        return role_types[role]

    specs = [_Spec("token_embd.weight", type_of("token_embd"), (n_embd, n_vocab))]
    for layer in range(n_layer):
        for base, role in _LAYER_ROLES:
            specs.append(_Spec(f"blk.{layer}.{base}.weight", type_of(role), shapes[base]))
    specs.append(_Spec("output_norm.weight", role_types["norm"], (n_embd,)))
    specs.append(_Spec("output.weight", type_of("output"), (n_embd, n_vocab)))
    return specs


def _round_to(x: float, step: int) -> int:
    return max(step, round(x / step) * step)


def _plan(
    size_bytes: int,
    *,
    types: str,
    n_layer: int | None,
    split_count: int,
    include_q8_1: bool,
    include_q2_0: bool,
) -> _Plan:
    preset_key = types if types in _PRESETS or types == _ALL_TYPES else types.upper()
    slots: list[int] = []
    if preset_key == _ALL_TYPES:
        preset = _PRESETS["f16"]
        every = _all_types(include_q8_1, include_q2_0)
        # token_embd + output + 7 matrices per layer must hold every type at least once.
        min_layers = math.ceil((len(every) - 2) / _MATRICES_PER_LAYER)
        if n_layer is not None and n_layer < min_layers:
            raise ValueError(f"types='all-types' needs n_layer >= {min_layers}, got {n_layer}")
        n_layer = max(n_layer or 0, min_layers)
        # Repeat the list so every matrix slot has a type; the repeats are harmless.
        slots = (every * (2 + n_layer * _MATRICES_PER_LAYER))[: 2 + n_layer * _MATRICES_PER_LAYER]
        file_type = int(_FT.MOSTLY_F16)
    elif preset_key in _PRESETS:
        preset = _PRESETS[preset_key]
        file_type = preset.file_type
    else:
        try:
            ggml = ggml_type_by_name(types)
        except KeyError:
            known = ", ".join(PRESET_NAMES)
            raise ValueError(
                f"unknown types preset {types!r}; use {known} or a type name"
            ) from None
        if not ggml.valid:
            raise ValueError(f"ggml type {ggml.name} was removed from ggml and cannot be written")
        # No llama_ftype for every type: leave it out and let readers guess, as llama.cpp does.
        preset = _uniform(ggml.name, -1)
        file_type = -1
    role_types = {role: ggml_type_by_name(name).id for role, name in preset.roles.items()}

    if n_layer is None:
        # Deeper models for bigger sizes, roughly as real ones scale: 64 MiB -> 4, 4 GiB -> 16.
        n_layer = min(80, max(2, round(4 * (size_bytes / (64 * MiB)) ** (1 / 3))))
    if n_layer < 1:
        raise ValueError(f"n_layer must be >= 1, got {n_layer}")
    n_vocab = len(_vocab())

    def total(n_embd: int, n_ff: int) -> int:
        return sum(s.nbytes for s in _layout(n_layer, n_embd, n_ff, n_vocab, role_types, slots))

    # For a fixed n_embd the model is A + n_ff * B bytes, so the best n_ff (a multiple of
    # 256, like n_embd, so every block size divides every row) is a division. Try each
    # n_embd up to the first too wide for a llama-like n_ff; keep the closest size, and
    # among those within ~1% the most llama-like n_ff / n_embd.
    best: tuple[float, int, int] | None = None
    n_embd = 256
    while n_embd <= 65536:
        base = total(n_embd, 0)
        slope = (total(n_embd, 256) - base) / 256
        n_ff = min(4 * n_embd, _round_to((size_bytes - base) / slope, 256))
        error = abs(base + n_ff * slope - size_bytes) / size_bytes
        score = error + 0.01 * abs(math.log(n_ff / n_embd / _FF_RATIO))
        if best is None or score < best[0]:
            best = (score, n_embd, n_ff)
        if total(n_embd, _round_to(n_embd * _FF_RATIO, 256)) > size_bytes:
            break
        n_embd += 256
    assert best is not None
    _, n_embd, n_ff = best
    specs = tuple(_layout(n_layer, n_embd, n_ff, n_vocab, role_types, slots))

    if not 1 <= split_count <= min(len(specs), 65535):
        raise ValueError(f"split_count must be in [1, {min(len(specs), 65535)}], got {split_count}")
    n_head, n_head_kv = _heads(n_embd)
    return _Plan(
        preset=preset_key,
        file_type=file_type,
        n_layer=n_layer,
        n_embd=n_embd,
        n_ff=n_ff,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_vocab=n_vocab,
        specs=specs,
        shard_starts=_shard_starts([s.nbytes for s in specs], split_count),
    )


def _shard_starts(sizes: list[int], split_count: int) -> tuple[int, ...]:
    """First tensor of each shard: cut where the bytes so far pass k/n of the total,
    keeping at least one tensor per shard."""
    total = sum(sizes)
    before = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    starts = [0]
    for k in range(1, split_count):
        cut = int(np.searchsorted(before, total * k / split_count))
        cut = min(max(cut, starts[-1] + 1), len(sizes) - (split_count - k))
        starts.append(cut)
    return tuple(starts)


# Common English words, split in _vocab (a literal list would take eighty lines).
_WORDS = (
    "the of and to in is that it for on was with as be by at this have from or an are not "
    "but had his they you were her she which their all one would there will been has when "
    "who more no if out so what up said about into than them can only other time new some "
    "could these two may first then do any like my now over such our man me even most made"
)


def _vocab() -> list[tuple[str, float, int]]:
    """A small sentencepiece-style vocabulary: (piece, score, token type)."""
    normal, unknown, control, byte = (
        int(gguf.TokenType.NORMAL),
        int(gguf.TokenType.UNKNOWN),
        int(gguf.TokenType.CONTROL),
        int(gguf.TokenType.BYTE),
    )
    vocab = [("<unk>", 0.0, unknown), ("<s>", 0.0, control), ("</s>", 0.0, control)]
    vocab += [(f"<0x{b:02X}>", 0.0, byte) for b in range(256)]
    pieces = [f"▁{w}" for w in _WORDS.split()] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab += [(p, -float(i), normal) for i, p in enumerate(pieces)]
    return vocab


# ---------------------------------------------------------------------------------------
# Data: random bytes with valid scales, made and written one chunk at a time.

_NAN_BITS: dict[ScaleKind, int] = {
    ScaleKind.FP16: 0x7E00,
    ScaleKind.F32: 0x7FC00000,
    ScaleKind.E8M0: 0xFF,
    ScaleKind.IQ1M: 0x7E00,
}
_INF_BYTES: dict[str, bytes] = {
    "F32": np.float32(np.inf).tobytes(),
    "F16": np.float16(np.inf).tobytes(),
    "BF16": (0x7F80).to_bytes(2, "little"),
    "F64": np.float64(np.inf).tobytes(),
}
_BF16_NAN = 0x7FC0


@dataclass(frozen=True, slots=True)
class _Patch:
    """New bytes for the tensor range [start, start + len(data)); ``mask`` keeps the
    bits where it is 0 (IQ1_M's scale shares its bytes with other fields)."""

    start: int
    data: bytes
    mask: bytes | None = None


def _iq1m_bytes(
    bits: npt.NDArray[np.uint16], big_endian: bool
) -> list[tuple[int, npt.NDArray[np.uint8]]]:
    """(byte offset in block, high-nibble value) for IQ1_M's fp16 scale, nibble k of the
    scale going to the top nibble of the u16 word at 48 + 2k."""
    out = []
    for k in range(4):
        word = 48 + 2 * k
        # The top nibble of a u16 is in its second byte little-endian, its first big-endian.
        high_byte = word if big_endian else word + 1
        out.append((high_byte, (((bits >> (4 * k)) & 0xF) << 4).astype(np.uint8)))
    return out


def _scale_bits(field_: ScaleField, n: int, rng: np.random.Generator) -> npt.NDArray[Any]:
    """``n`` valid values of a scale field, as raw bits."""
    if field_.kind is ScaleKind.E8M0:
        # 2^(e-127) for e in 100..140: finite, never the 0xFF NaN.
        return rng.integers(100, 141, n, dtype=np.uint8)
    if field_.kind is ScaleKind.UE4M3:
        # Never checked; keep them ordinary anyway (well below 0x7F, E4M3's NaN).
        return rng.integers(0x20, 0x50, n, dtype=np.uint8)
    values = rng.uniform(1e-4, 1e-2, n)
    if field_.kind is ScaleKind.F32:
        return values.astype(np.float32).view(np.uint32)
    return values.astype(np.float16).view(np.uint16)


def _put_scale(
    blocks: npt.NDArray[np.uint8], field_: ScaleField, bits: npt.NDArray[Any], big_endian: bool
) -> None:
    """Write one scale value per block (rows of ``blocks``) in the file's byte order."""
    if field_.kind is ScaleKind.IQ1M:
        for pos, nibble in _iq1m_bytes(bits.astype(np.uint16), big_endian):
            blocks[:, pos] = (blocks[:, pos] & 0x0F) | nibble
        return
    width = bits.dtype.itemsize
    order: Literal[">", "<"] = ">" if big_endian else "<"
    raw = bits.astype(bits.dtype.newbyteorder(order), copy=False).view(np.uint8)
    blocks[:, field_.offset : field_.offset + width] = raw.reshape(-1, width)


def _finite_mask(ggml: GGMLType, big_endian: bool) -> npt.NDArray[Any] | None:
    """An AND-mask for one element of a float type that clears the top exponent bit, so
    random bits become finite values below 2 in magnitude; None for non-float types."""
    if ggml.name not in _INF_BYTES:
        return None
    width = ggml.block_bytes
    mask = bytearray(b"\xff" * width)
    # The sign+exponent byte is last little-endian, first big-endian; 0xBF clears bit 6 of it.
    mask[0 if big_endian else width - 1] = 0xBF
    return np.frombuffer(bytes(mask), dtype=f"u{width}")


def _corruption_patch(c: Corruption, spec: _Spec, big_endian: bool, where: str) -> _Patch:
    ggml = GGML_TYPES[spec.type_id]
    kind = CorruptionKind(c.kind)
    n_blocks = spec.nbytes // ggml.block_bytes
    order: Literal["big", "little"] = "big" if big_endian else "little"
    problem = None
    if c.index >= n_blocks:
        problem = f"index {c.index} out of range: the tensor has {n_blocks} blocks/elements"
    elif kind is CorruptionKind.NAN_SCALE:
        checked = [f for f in ggml.scales if f.checked]
        if not checked:
            problem = f"type {ggml.name} has no checked scale field"
        else:
            f = checked[0]
            start = c.index * ggml.block_bytes
            if f.kind is ScaleKind.IQ1M:
                data = bytearray(8)
                mask = bytearray(8)
                bits = np.array([_NAN_BITS[f.kind]], dtype=np.uint16)
                for pos, nibble in _iq1m_bytes(bits, big_endian):
                    data[pos - 48], mask[pos - 48] = int(nibble[0]), 0xF0
                return _Patch(start + 48, bytes(data), bytes(mask))
            width = {ScaleKind.FP16: 2, ScaleKind.F32: 4, ScaleKind.E8M0: 1}[f.kind]
            return _Patch(start + f.offset, _NAN_BITS[f.kind].to_bytes(width, order))
    elif kind is CorruptionKind.INF_ELEMENT:
        if ggml.name not in _INF_BYTES:
            problem = f"inf_element needs an F32/F16/BF16/F64 tensor, not {ggml.name}"
        else:
            inf = _INF_BYTES[ggml.name]
            inf = inf[::-1] if big_endian else inf
            return _Patch(c.index * ggml.block_bytes, inf)
    elif kind is CorruptionKind.BF16_NAN:
        if ggml.name != "BF16":
            problem = f"bf16_nan needs a BF16 tensor, not {ggml.name}"
        else:
            return _Patch(c.index * 2, _BF16_NAN.to_bytes(2, order))
    else:
        start = c.index * ggml.block_bytes
        if start + c.length > spec.nbytes:
            problem = f"ff_fill of {c.length} bytes at byte {start} passes the end ({spec.nbytes})"
        else:
            return _Patch(start, b"\xff" * c.length)
    raise ValueError(f"{where}: corruption {kind.value} of '{c.tensor}' ({ggml.name}): {problem}")


def _apply(chunk: npt.NDArray[np.uint8], chunk_start: int, patch: _Patch) -> None:
    lo = max(patch.start, chunk_start)
    hi = min(patch.start + len(patch.data), chunk_start + len(chunk))
    if lo >= hi:
        return
    target = chunk[lo - chunk_start : hi - chunk_start]
    new = np.frombuffer(patch.data, np.uint8)[lo - patch.start : hi - patch.start]
    if patch.mask is None:
        target[:] = new
    else:
        keep = np.frombuffer(patch.mask, np.uint8)[lo - patch.start : hi - patch.start]
        target[:] = (target & ~keep) | (new & keep)


class _DataMaker:
    """Makes each tensor's bytes in chunks: a window of the random pool, then valid
    scales (quantized types) or a finiteness mask (float types), then the patches."""

    def __init__(self, rng: np.random.Generator, max_tensor_bytes: int, big_endian: bool) -> None:
        self._rng = rng
        self._big_endian = big_endian
        self._pool = np.frombuffer(rng.bytes(min(_POOL_BYTES, max_tensor_bytes) + 64), np.uint8)
        self._buf = np.empty(min(_CHUNK_BYTES, max_tensor_bytes) + 512, np.uint8)

    def chunks(self, spec: _Spec, patches: Sequence[_Patch]) -> Iterator[memoryview]:
        ggml = GGML_TYPES[spec.type_id]
        bb = ggml.block_bytes
        blocks_per_chunk = max(1, min(_CHUNK_BYTES, len(self._buf)) // bb)
        mask = _finite_mask(ggml, self._big_endian)
        done = 0
        while done < spec.nbytes:
            n = min(blocks_per_chunk * bb, spec.nbytes - done)
            chunk = self._buf[:n]
            src = int(self._rng.integers(0, len(self._pool) - n + 1))
            chunk[:] = self._pool[src : src + n]
            if mask is not None:
                values = chunk.view(mask.dtype)
                np.bitwise_and(values, mask, out=values)
            elif ggml.scales:
                rows = chunk.reshape(-1, bb)
                for f in ggml.scales:
                    _put_scale(rows, f, _scale_bits(f, len(rows), self._rng), self._big_endian)
            for patch in patches:
                _apply(chunk, done, patch)
            yield chunk.data
            done += n


# ---------------------------------------------------------------------------------------
# Writing.


def _add_metadata(writer: gguf.GGUFWriter, plan: _Plan, name: str) -> None:
    writer.add_name(name)
    if plan.file_type >= 0:
        writer.add_file_type(plan.file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(4096)
    writer.add_embedding_length(plan.n_embd)
    writer.add_block_count(plan.n_layer)
    writer.add_feed_forward_length(plan.n_ff)
    writer.add_head_count(plan.n_head)
    writer.add_head_count_kv(plan.n_head_kv)
    writer.add_rope_dimension_count(plan.n_embd // plan.n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(plan.n_vocab)
    vocab = _vocab()
    writer.add_tokenizer_model("llama")
    writer.add_token_list([piece for piece, _, _ in vocab])
    writer.add_token_scores([score for _, score, _ in vocab])
    writer.add_token_types([token_type for _, _, token_type in vocab])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)


def _write_padding(fout: BinaryIO, alignment: int) -> None:
    pad = -fout.tell() % alignment
    if pad:
        fout.write(b"\x00" * pad)


def write_synthetic_model(
    path: str | os.PathLike[str],
    *,
    size_bytes: int | str = GiB,
    seed: int = 0,
    split_count: int = 1,
    big_endian: bool = False,
    types: str | None = None,
    n_layer: int | None = None,
    corruptions: Sequence[Corruption] = (),
    alignment: int | None = None,
    include_q8_1: bool = False,
    include_q2_0: bool = True,
) -> SynthModel:
    """Write a random llama-shaped model of about ``size_bytes`` tensor bytes.

    Parameters:
        path: the file, or with ``split_count > 1`` the prefix: ``m.gguf`` becomes
            ``m-00001-of-00003.gguf`` … (gguf-split's names and ``split.*`` keys; only the
            first shard carries the model metadata).
        size_bytes: target tensor bytes (``int`` or ``"64MiB"``): from 64 MiB up hit to
            within 5% (mostly 1%), coarser below; ~1 MiB is about the smallest model.
        seed: same arguments and seed give the same bytes. Corruptions draw nothing from
            the generator, so a damaged file differs from its clean twin only where asked.
        big_endian: write a big-endian (GGUF v3) file; all fields, scales included, are
            byte-swapped. aiogguf loads only element types (F32/F16/BF16/F64/I*) from such
            files, hence the ``"float"`` default preset there.
        types: a preset name (module docstring) or a ggml type name; default ``"mixed"``,
            or ``"float"`` when ``big_endian``.
        n_layer: number of blocks; default grows with the size.
        corruptions: damage to write into the data (``Corruption``).
        alignment: write ``general.alignment`` and pad to it (single files only).
        include_q8_1: all-types only: add a Q8_1 tensor (36-byte blocks as in ggml's C
            struct; gguf-py's reader assumes 40, and ggml's validator rejects the type).
        include_q2_0: all-types only: add a Q2_0 tensor (id 42). gguf 0.19's
            ``GGUFReader`` does not know that id and refuses the file: pass ``False`` for
            a file it can read.

    Returns the ``SynthModel`` record of what was written.

    Raises ``ValueError`` for an unknown preset, a bad split count or alignment, or a
    corruption that does not fit its tensor (nothing is written then), and ``OSError``
    when writing fails (the partial files are removed).
    """
    size = parse_size(size_bytes)
    preset = types or ("float" if big_endian else "mixed")
    plan = _plan(
        size,
        types=preset,
        n_layer=n_layer,
        split_count=split_count,
        include_q8_1=include_q8_1,
        include_q2_0=include_q2_0,
    )
    if alignment is not None and (alignment <= 0 or alignment & (alignment - 1)):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    if alignment is not None and split_count > 1:
        # Later shards carry only the split keys, so they would be read with the default 32.
        raise ValueError("a custom alignment cannot be combined with split_count > 1")

    out = Path(path)
    by_name = {s.name: s for s in plan.specs}
    patches: dict[str, list[_Patch]] = {}
    for c in corruptions:
        if c.tensor not in by_name:
            raise ValueError(f"{out}: corruption names tensor '{c.tensor}', which the model lacks")
        patches.setdefault(c.tensor, []).append(
            _corruption_patch(c, by_name[c.tensor], big_endian, os.fspath(out))
        )

    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    writer = gguf.GGUFWriter(out, "llama", endianess=endian)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    _add_metadata(writer, plan, f"aiogguf synthetic {plan.preset} seed {seed}")
    starts = set(plan.shard_starts[1:])
    for i, spec in enumerate(plan.specs):
        if i in starts:
            # A new shard dict makes the writer start the next file here (its own
            # splitting is by size or count limits, not by a shard count).
            writer.tensors.append({})
        writer.add_tensor_info(
            spec.name,
            spec.shape[::-1],
            # Any dtype but uint8: the writer then takes the shape as element counts.
            np.dtype(np.float32),
            spec.nbytes,
            # Q2_0 (id 42) is newer than gguf 0.19's enum; the writer only packs the int.
            raw_dtype=cast(Any, spec.type_id),
        )

    # The writer's own shard names are gguf-split's: <stem>-00001-of-00003.gguf.
    paths = tuple(writer.format_shard_names(out))
    tensors: list[SynthTensor] = []
    rng = np.random.default_rng(seed)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None
        maker = _DataMaker(rng, max(s.nbytes for s in plan.specs), big_endian)
        bounds = [*plan.shard_starts, len(plan.specs)]
        for shard, fout in enumerate(writer.fout):
            _write_padding(fout, writer.data_alignment)
            data_offset = fout.tell()
            for spec in plan.specs[bounds[shard] : bounds[shard + 1]]:
                start = fout.tell()
                tensors.append(
                    SynthTensor(
                        spec.name,
                        spec.type_id,
                        spec.shape,
                        spec.nbytes,
                        shard,
                        start - data_offset,
                        start,
                    )
                )
                for chunk in maker.chunks(spec, patches.get(spec.name, ())):
                    fout.write(chunk)
                _write_padding(fout, writer.data_alignment)
        writer.close()
    except BaseException:
        writer.close()
        for p in paths:
            p.unlink(missing_ok=True)
        raise

    return SynthModel(
        paths=paths,
        preset=plan.preset,
        seed=seed,
        big_endian=big_endian,
        n_layer=plan.n_layer,
        n_embd=plan.n_embd,
        n_ff=plan.n_ff,
        n_head=plan.n_head,
        n_head_kv=plan.n_head_kv,
        n_vocab=plan.n_vocab,
        n_tensors=len(plan.specs),
        tensor_bytes=plan.tensor_bytes,
        file_bytes=sum(p.stat().st_size for p in paths),
        tensors=tuple(tensors),
        corruptions=tuple(corruptions),
    )
