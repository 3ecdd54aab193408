"""The index stage: parsed files → one checked ``WeightIndex`` (design §1.2).

Pure and synchronous: absolute offsets and bounds per file (format §5.5), duplicate
names across splits, the split checks of llama.cpp plus the agreement checks it skips
(§2.4), tensor classes (§3.1) and llama.cpp's layer order (§3.2).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from aiogguf._names import MAX_LAYERS, layer_number, layer_of
from aiogguf._records import ParsedFile, TensorClass, TensorEntry, Totals, WeightIndex
from aiogguf._units import counted
from aiogguf.errors import GGUFFormatError, SplitError
from aiogguf.io.workers import raise_if_stopped

__all__ = [
    "build_index",
    "tensor_class",
]

U64_LIMIT: Final = 1 << 64
# Name-based classification, tried in this order (format §3.1).
_REPEATING_PREFIXES: Final = ("blk.", "enc.blk.", "dec.blk.", "posnet.", "convnext.")
_INPUT_NAMES: Final = frozenset(
    {
        "token_embd",
        "position_embd",
        "token_types",
        "per_layer_token_embd",
        "masked_embd_centroids",
        "masked_embd_ordering",
    }
)
_OUTPUT_NAMES: Final = frozenset(
    {
        "output",
        "output_norm",
        "cls",
        "cls.output",
        "cls.norm",
        "dense_2",
        "dense_3",
        "enc.output_norm",
        "dec.output_norm",
        "altup_proj",
        "altup_unembd_proj",
        "nextn.post_projection",
        "output_hc_fn",
        "output_hc_base",
        "output_hc_scale",
        "fc",
        "d2t",
    }
)
_GLOBAL_REPEATING_NAMES: Final = frozenset(
    {
        "rope_freqs",
        "rope_factors_long",
        "rope_factors_short",
        "token_embd_norm",
        "per_layer_model_proj",
        "per_layer_proj_norm",
        "conv1d",
        "nextn.pre_projection",
    }
)


def _in(names: frozenset[str], name: str) -> bool:
    # A name is ``<base>.<suffix>`` (weight, bias, scale…) or a bare base.
    return name in names or name.rpartition(".")[0] in names


def tensor_class(name: str) -> TensorClass | None:
    """llama.cpp's layer class of a tensor by its name; None when the name is unknown."""
    if name.startswith(_REPEATING_PREFIXES):
        return TensorClass.REPEATING
    if _in(_INPUT_NAMES, name):
        return TensorClass.INPUT
    if _in(_OUTPUT_NAMES, name):
        return TensorClass.OUTPUT
    if _in(_GLOBAL_REPEATING_NAMES, name):
        return TensorClass.REPEATING
    return None


def _check_split_set(files: Sequence[ParsedFile]) -> int | None:
    """Split checks (format §2.4) plus the agreement checks llama.cpp skips.

    Runs before the tensors are indexed, so a shard of another set is named as such
    rather than as a duplicate tensor. Returns ``split.tensors.count`` for a split set.
    """
    first = files[0]
    count = first.split_int("split.count")
    if count is None or count <= 1:
        if len(files) > 1:
            raise SplitError(
                first.path, f"{len(files)} files given but the first has no split.count > 1"
            )
        return None
    if len(files) != count:
        given = counted(len(files), "file was", "files were")
        raise SplitError(first.path, f"split.count is {count} but {given} given")
    total = first.split_int("split.tensors.count")
    if total is None:
        raise SplitError(first.path, f"split.count is {count} but split.tensors.count is missing")
    for i, parsed in enumerate(files):
        no = parsed.split_int("split.no")
        if no is None:
            raise SplitError(parsed.path, "split.no is missing from this split")
        if no != i:
            raise SplitError(
                parsed.path, f"split.no is {no} but this file is split {i + 1} (split.no {i})"
            )
        if i == 0:
            continue
        # A shard of another split set (another quant of the same model) says so here.
        for key, want in (("split.count", count), ("split.tensors.count", total)):
            got = parsed.split_int(key)
            if got != want:
                raise SplitError(
                    parsed.path,
                    f"{key} is {got} but the first split {first.path} says {want}: "
                    "this file belongs to another split set",
                )
    return total


def _check_block_count(
    first: ParsedFile, named_layers: int, has_tensors: bool, warnings: list[str]
) -> None:
    """``<arch>.block_count`` drives a loop and a record per layer in the plan: it must
    be at least 0 and at most ``MAX_LAYERS``. More layers than the tensors name is
    allowed (llama.cpp makes empty layers) with a warning; fewer is the plan's error
    (it names the tensor that lies beyond)."""
    arch = first.get("general.architecture")
    if not isinstance(arch, str):
        return
    key = f"{arch}.block_count"
    entry = first.metadata.get(key)
    if entry is None or isinstance(entry.value, bool) or not isinstance(entry.value, int):
        return
    value = entry.value
    if value < 0:
        raise GGUFFormatError(first.path, entry.offset, key, f"{value} layers: negative")
    if value > MAX_LAYERS:
        raise GGUFFormatError(
            first.path,
            entry.offset,
            key,
            f"{value} layers exceed the cap of {MAX_LAYERS} (llama.cpp's LLAMA_MAX_LAYERS); "
            f"the tensors name {named_layers}",
        )
    if has_tensors and value > named_layers:
        warnings.append(
            f"{key} is {value} but the tensors name {named_layers} layers: "
            f"layers {named_layers} … {value - 1} are empty"
        )


def build_index(files: Sequence[ParsedFile]) -> WeightIndex:
    """Check the tensors of a model's files and order them as llama.cpp does.

    ``files``: one ``ParsedFile`` per file, in split order (as ``parse_model`` returns).
    Returns the index: absolute offsets, layers, classes, totals, lookup by name.
    Raises ``GGUFFormatError``: a tensor's data lies outside its file (truncated file) or its
        end does not fit in 64 bits; ``<arch>.block_count`` is negative or beyond
        ``MAX_LAYERS``, or a tensor's layer number is.
    Raises ``SplitError``: a tensor is in two splits, or the splits do not form one set
        (count, position, ``split.tensors.count``).
    """
    if not files:
        raise ValueError("build_index needs at least one file")
    warnings: list[str] = []
    expected_total = _check_split_set(files)
    by_name: dict[str, TensorEntry] = {}
    highest = -1  # the highest layer a tensor's name gives
    for file_index, parsed in enumerate(files):
        for k, info in enumerate(parsed.tensors):
            if not k & 255:
                raise_if_stopped()  # the load was cancelled: stop within 256 tensors
            start = parsed.data_offset + info.offset
            end = start + info.nbytes
            if end >= U64_LIMIT:
                raise GGUFFormatError(
                    parsed.path,
                    info.info_offset,
                    f"tensor '{info.name}'",
                    f"data end {start} + {info.nbytes} overflows 64 bits",
                )
            if end > parsed.file_size:
                raise GGUFFormatError(
                    parsed.path,
                    info.info_offset,
                    f"tensor '{info.name}'",
                    f"data [{start}, {end}) is not within the file ({parsed.file_size} bytes): "
                    "the file is truncated or corrupt",
                )
            seen = by_name.get(info.name)
            if seen is not None:
                other = files[seen.file_index].path
                raise SplitError(
                    parsed.path, f"tensor '{info.name}' is duplicated: it is also in {other}"
                )
            layer = layer_of(info.name)
            number = layer_number(info.name)
            if number is not None and number > highest:
                if number >= MAX_LAYERS:
                    raise GGUFFormatError(
                        parsed.path,
                        info.info_offset,
                        f"tensor '{info.name}'",
                        f"layer {number} is beyond the cap of {MAX_LAYERS} layers "
                        "(llama.cpp's LLAMA_MAX_LAYERS)",
                    )
                highest = number
            cls = tensor_class(info.name)
            if cls is None:
                warnings.append(f"tensor '{info.name}': unknown name, classed as input")
                cls = TensorClass.INPUT
            by_name[info.name] = TensorEntry(
                name=info.name,
                type=info.type,
                shape=info.shape,
                file_index=file_index,
                offset=start,
                nbytes=info.nbytes,
                n_elements=info.n_elements,
                layer=layer,
                tensor_class=cls,
            )
    _check_block_count(files[0], highest + 1, bool(by_name), warnings)
    if expected_total is not None and expected_total != len(by_name):
        raise SplitError(
            files[0].path,
            f"split.tensors.count is {expected_total} but the {len(files)} splits hold "
            f"{counted(len(by_name), 'tensor')}",
        )

    def order(entry: TensorEntry) -> tuple[int, bytes]:
        return (-1 if entry.layer is None else entry.layer, entry.name.encode())

    tensors = tuple(sorted(by_name.values(), key=order))
    nbytes = sum(t.nbytes for t in tensors)
    n_elements = sum(t.n_elements for t in tensors)
    totals = Totals(
        n_tensors=len(tensors),
        nbytes=nbytes,
        n_elements=n_elements,
        bpw=nbytes * 8 / n_elements if n_elements else 0.0,
    )
    return WeightIndex(
        files=tuple(files),
        tensors=tensors,
        totals=totals,
        warnings=tuple(warnings),
        _by_name={t.name: t for t in tensors},
    )
