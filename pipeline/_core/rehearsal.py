"""The model ``warm_up`` loads once, so that a process's first real load runs on warm
code: a four-layer llama-shaped GGUF of about 40 KiB, built in memory, and the opener
that serves it from an anonymous file.

A fresh interpreter runs every function of the load path for the first time on its first
load: specialising the bytecode, filling attribute caches and importing what is imported
late make that load slower than the ones after it (the README has the figures), most of
it in parsing and planning. A rehearsal on this model pays for that during ``warm_up``
instead, through the same stages, modes and devices as the load it prepares. Its
vocabulary and its tensors are many enough that each per-key and per-tensor path runs
more often than the interpreter waits before specialising it. Its weights are zeros,
which every check accepts.
"""

from __future__ import annotations

import functools
import os
import struct

from aiogguf.errors import LoadError
from aiogguf.io.buffers import Closeable, ResourceState
from aiogguf.io.ggml_types import ggml_type_by_name

__all__ = ["NAME", "RehearsalFile", "rehearsal_model"]

# The name the rehearsal's file goes by in messages (it has no path).
NAME = "<aiogguf warm-up model>"

_ALIGNMENT = 32
_UINT32, _INT32, _FLOAT32, _STRING, _ARRAY = 4, 5, 6, 8, 9
_ROW = 256  # elements per row: one block of every k-quant type
_LAYERS = 4
_VOCAB = 64

# Name, type, rows: what a llama model's layers hold, in the types a quantised file uses.
_TENSORS: tuple[tuple[str, str, int], ...] = (
    ("token_embd.weight", "Q4_K", 8),
    *(
        (f"blk.{layer}.{name}", type_name, rows)
        for layer in range(_LAYERS)
        for name, type_name, rows in (
            ("attn_norm.weight", "F32", 1),
            ("attn_q.weight", "Q4_K", 4),
            ("attn_k.weight", "Q4_K", 4),
            ("attn_v.weight", "Q8_0", 4),
            ("attn_output.weight", "F16", 4),
            ("ffn_norm.weight", "F32", 1),
            ("ffn_gate.weight", "Q4_K", 4),
            ("ffn_up.weight", "Q5_K", 4),
            ("ffn_down.weight", "Q6_K", 4),
        )
    ),
    ("output_norm.weight", "F32", 1),
    ("output.weight", "Q6_K", 8),
)


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, kind: int, value: bytes) -> bytes:
    return _string(key) + struct.pack("<I", kind) + value


def _array(kind: int, items: list[bytes]) -> bytes:
    return struct.pack("<IQ", kind, len(items)) + b"".join(items)


def _metadata() -> list[bytes]:
    """A llama model's keys, vocabulary included (parsing arrays is a path of its own)."""

    def u32(key: str, value: int) -> bytes:
        return _kv(key, _UINT32, struct.pack("<I", value))

    return [
        _kv("general.architecture", _STRING, _string("llama")),
        _kv("general.name", _STRING, _string("aiogguf warm-up")),
        u32("general.file_type", 15),
        u32("general.quantization_version", 2),
        u32("llama.context_length", 2048),
        u32("llama.embedding_length", _ROW),
        u32("llama.block_count", _LAYERS),
        u32("llama.feed_forward_length", 4 * _ROW),
        u32("llama.attention.head_count", 4),
        u32("llama.attention.head_count_kv", 4),
        u32("llama.rope.dimension_count", _ROW // 4),
        _kv("llama.attention.layer_norm_rms_epsilon", _FLOAT32, struct.pack("<f", 1e-5)),
        u32("llama.vocab_size", _VOCAB),
        _kv("tokenizer.ggml.model", _STRING, _string("llama")),
        _kv(
            "tokenizer.ggml.tokens",
            _ARRAY,
            _array(_STRING, [_string(f"<t{i}>") for i in range(_VOCAB)]),
        ),
        _kv(
            "tokenizer.ggml.scores",
            _ARRAY,
            _array(_FLOAT32, [struct.pack("<f", -i) for i in range(_VOCAB)]),
        ),
        _kv(
            "tokenizer.ggml.token_type",
            _ARRAY,
            _array(_INT32, [struct.pack("<i", 1) for _ in range(_VOCAB)]),
        ),
        u32("tokenizer.ggml.bos_token_id", 1),
        u32("tokenizer.ggml.eos_token_id", 2),
        u32("tokenizer.ggml.unknown_token_id", 0),
    ]


@functools.cache
def rehearsal_model() -> bytes:
    """The rehearsal model's bytes (GGUF v3, little-endian)."""
    metadata = _metadata()
    infos: list[bytes] = []
    offset = 0
    for name, type_name, rows in _TENSORS:
        ggml = ggml_type_by_name(type_name)
        shape = (_ROW,) if rows == 1 else (_ROW, rows)
        infos.append(
            _string(name) + struct.pack(f"<I{len(shape)}QIQ", len(shape), *shape, ggml.id, offset)
        )
        offset += -(-ggml.nbytes(_ROW * rows) // _ALIGNMENT) * _ALIGNMENT
    header = b"GGUF" + struct.pack("<IQQ", 3, len(_TENSORS), len(metadata))
    header += b"".join(metadata) + b"".join(infos)
    header += bytes(-len(header) % _ALIGNMENT)
    return header + bytes(offset)


class RehearsalFile(Closeable):
    """The rehearsal model in an anonymous in-memory file (``memfd``), and an opener
    (``aiogguf.io.opener.FileOpener``) that serves it whatever the path: it lives in no
    directory, leaves nothing behind, and maps and reads like a file on disk (but for
    ``O_DIRECT``). Making one writes the model and ``close`` drops it; both block. Use
    it as a context manager.

    Raises ``OSError`` where the system makes no anonymous file."""

    name = NAME  # what a load of it is called

    def __init__(self) -> None:
        data = rehearsal_model()
        fd = os.memfd_create("aiogguf-warm-up", os.MFD_CLOEXEC)
        try:
            written = 0
            while written < len(data):
                written += os.write(fd, data[written:])
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._state = ResourceState.OPEN

    def close(self) -> None:
        if self._state is ResourceState.OPEN:
            self._state = ResourceState.CLOSED
            os.close(self._fd)

    def open(self, path: str) -> int:
        """A new descriptor of the rehearsal model (``path`` only names it)."""
        if self._state is not ResourceState.OPEN:
            raise LoadError(path, None, "the warm-up model is closed")
        return os.dup(self._fd)
