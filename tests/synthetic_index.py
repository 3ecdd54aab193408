"""Hand-built ``WeightIndex`` objects for plan tests: no file, no parser, exact layout.

``llama_index(n_layer)`` lays tensors out like gguf-py does (token_embd, blk.0 … blk.N-1,
output_norm, output), each at an offset aligned to 32 bytes after the previous one.
``build_index(specs)`` takes an explicit list of ``(name, type, shape)`` tuples.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from aiogguf._records import (
    MetadataEntry,
    ParsedFile,
    TensorClass,
    TensorEntry,
    Totals,
    ValueType,
    WeightIndex,
)
from aiogguf.io.ggml_types import ggml_type_by_name

__all__ = ["LAYER_TENSORS", "TensorSpec", "build_index", "llama_index"]

TensorSpec = tuple[str, str, tuple[int, ...]]  # name, ggml type name, shape (ne0 first)

LAYER_TENSORS: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("attn_norm.weight", (256,)),
    ("attn_q.weight", (256, 256)),
    ("attn_k.weight", (256, 128)),
    ("attn_v.weight", (256, 128)),
    ("attn_output.weight", (256, 256)),
    ("ffn_norm.weight", (256,)),
    ("ffn_gate.weight", (256, 512)),
    ("ffn_up.weight", (256, 512)),
    ("ffn_down.weight", (512, 256)),
)

_INPUT = {"token_embd", "position_embd", "token_types", "per_layer_token_embd"}
_OUTPUT = {"output", "output_norm", "cls", "cls.output", "cls.norm"}
_BLK = re.compile(r"^blk\.(\d+)\.")


def _classify(name: str) -> tuple[TensorClass, int | None]:
    match = _BLK.match(name)
    if match:
        return TensorClass.REPEATING, int(match.group(1))
    if name.startswith(("enc.blk.", "dec.blk.", "posnet.", "convnext.")):
        return TensorClass.REPEATING, None
    base = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
    if base in _INPUT:
        return TensorClass.INPUT, None
    if base in _OUTPUT:
        return TensorClass.OUTPUT, None
    return TensorClass.REPEATING, None  # rope_freqs and the other global repeating ones


def _type_of(name: str, default: str, types: Mapping[str, str]) -> str:
    for pattern, type_name in types.items():
        if re.search(pattern, name):
            return type_name
    return default


def llama_index(
    n_layer: int,
    *,
    tensor_type: str = "Q4_K",
    norm_type: str = "F32",
    types: Mapping[str, str] | None = None,
    block_count: int | None = -1,
    n_files: int = 1,
    gap: int = 0,
    extra: Sequence[TensorSpec] = (),
) -> WeightIndex:
    """A llama-shaped index of ``n_layer`` blocks. ``types`` maps regexes to type names
    (first match wins) for tensors that differ; ``block_count`` -1 means ``n_layer``,
    None leaves the key out; ``gap`` extra bytes between tensors; ``n_files`` splits the
    tensors round-robin in blocks over that many files."""
    types = types or {}
    specs: list[TensorSpec] = [("token_embd.weight", tensor_type, (256, 1024))]
    for il in range(n_layer):
        for suffix, shape in LAYER_TENSORS:
            name = f"blk.{il}.{suffix}"
            default = norm_type if len(shape) == 1 else tensor_type
            specs.append((name, _type_of(name, default, types), shape))
    specs.append(("output_norm.weight", norm_type, (256,)))
    specs.append(("output.weight", _type_of("output.weight", "Q6_K", types), (256, 1024)))
    specs.extend(extra)
    specs = [(n, _type_of(n, t, types), s) for n, t, s in specs]
    return build_index(
        specs,
        block_count=n_layer if block_count == -1 else block_count,
        n_files=n_files,
        gap=gap,
    )


def build_index(
    specs: Sequence[TensorSpec],
    *,
    block_count: int | None,
    n_files: int = 1,
    gap: int = 0,
    alignment: int = 32,
    data_offset: int = 4096,
) -> WeightIndex:
    """An index of ``specs`` laid out in order (file ``i * n_files // len(specs)``), each
    tensor at the next ``alignment`` boundary plus ``gap`` bytes."""
    n = len(specs)
    per_file: list[list[TensorEntry]] = [[] for _ in range(n_files)]
    cursor = [data_offset] * n_files
    for i, (name, type_name, shape) in enumerate(specs):
        file_index = i * n_files // n if n else 0
        ggml = ggml_type_by_name(type_name)
        n_elements = 1
        for d in shape:
            n_elements *= d
        nbytes = ggml.nbytes(n_elements) if ggml.block_elems else 0
        offset = -(-cursor[file_index] // alignment) * alignment
        tensor_class, layer = _classify(name)
        per_file[file_index].append(
            TensorEntry(
                name=name,
                type=ggml,
                shape=shape,
                file_index=file_index,
                offset=offset,
                nbytes=nbytes,
                n_elements=n_elements,
                layer=layer,
                tensor_class=tensor_class,
            )
        )
        cursor[file_index] = offset + nbytes + gap
    metadata: dict[str, MetadataEntry] = {
        "general.architecture": MetadataEntry(
            "general.architecture", ValueType.STRING, "llama", 24
        ),
    }
    if block_count is not None:
        metadata["llama.block_count"] = MetadataEntry(
            "llama.block_count", ValueType.UINT32, block_count, 64
        )
    files = tuple(
        ParsedFile(
            path=f"/synthetic/model-{i:05d}.gguf",
            version=3,
            byte_order="little",
            alignment=alignment,
            data_offset=data_offset,
            file_size=cursor[i],
            metadata=metadata if i == 0 else {},
            tensors=(),
        )
        for i in range(n_files)
    )
    entries = [t for file_entries in per_file for t in file_entries]
    entries.sort(key=lambda t: (t.layer if t.layer is not None else -1, t.name))
    total_bytes = sum(t.nbytes for t in entries)
    total_elements = sum(t.n_elements for t in entries)
    return WeightIndex(
        files=files,
        tensors=tuple(entries),
        totals=Totals(
            n_tensors=len(entries),
            nbytes=total_bytes,
            n_elements=total_elements,
            bpw=total_bytes * 8 / total_elements if total_elements else 0.0,
        ),
        _by_name={t.name: t for t in entries},
    )
