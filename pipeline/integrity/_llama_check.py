"""A load checked against a ``llama-gguf-hash`` manifest (format §8.5).

That format holds one digest per tensor and algorithm, over the tensor's data bytes,
and none per block: a tensor's digest can be taken only once all of it has landed, in
order. So each tensor is hashed from where it landed once the reads are done: a host
tensor in the host image; a device tensor copied back in chunks; a mapped or
byte-swapped one read from its file in chunks, never through the mapping
(``images.tensor_chunks``).

Of the algorithms a tensor's lines give, the load checks the fastest (xxh3, xxh64, then
sha1, sha256); ``aiogguf verify --manifest`` checks every line, the whole-model ones
too. Tensors a manifest has no line for (gguf-py's script leaves three kinds of bias
out: ``llama_hash.GGUF_PY_SKIPPED``) are not checked; a manifest with no tensor line at
all is refused, naming ``aiogguf verify``, which checks its whole-model lines.

``LlamaCheck.open`` matches the manifest to the model before any data is read, so a
manifest of another model is refused up front, as a block manifest is.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import xxhash

from aiogguf._images import Image, tensor_chunks
from aiogguf._jobs import BufferLayout, ReadJob, TensorSlot
from aiogguf._records import WeightIndex
from aiogguf.errors import IntegrityError, TensorFailure
from aiogguf.integrity._llama_hash import LlamaLine, match_llama, parse_llama, whole_model_only
from aiogguf.io.source import ByteSource

__all__ = ["LlamaCheck", "LlamaSink"]

# Fastest first: the one a load checks where a tensor has lines of several.
_PREFERENCE: Final = ("xxh3", "xxh64", "sha1", "sha256")
_NEW: Final[Mapping[str, Callable[[], Any]]] = {
    "xxh3": xxhash.xxh3_64,
    "xxh64": xxhash.xxh64,
    "sha1": hashlib.sha1,
    "sha256": hashlib.sha256,
}


@dataclass(frozen=True, slots=True)
class LlamaCheck:
    """A ``llama-gguf-hash`` manifest matched to a model: per tensor, the line checked."""

    path: str
    lines: Mapping[str, LlamaLine]

    @classmethod
    def open(cls, text: str, path: str, index: WeightIndex) -> LlamaCheck:
        """The manifest ``text`` (read from ``path``) matched to ``index``. Raises
        ``ManifestError`` (not a manifest, or one without tensor lines: nothing a load
        can check) or ``ManifestMismatchError`` (another model's)."""
        manifest = parse_llama(text, path)
        names = [os.path.basename(f.path) for f in index.files]
        tensor_files = {t.name: names[t.file_index] for t in index.tensors}
        chosen: dict[str, LlamaLine] = {}
        rank = {a: i for i, a in enumerate(_PREFERENCE)}
        for line, _, tensor in match_llama(manifest, tensor_files, names, path):
            if tensor is None or line.algorithm not in rank:
                continue
            held = chosen.get(tensor)
            if held is None or rank[line.algorithm] < rank[held.algorithm]:
                chosen[tensor] = line
        if not chosen:
            # Its whole-model lines need every byte of the model hashed in order: that is
            # verify's pass, not a load's, which would check nothing and say it passed.
            raise whole_model_only(path, index.files[0].path if index.files else "MODEL")
        return cls(path, chosen)


class LlamaSink:
    """The check of one load against a ``LlamaCheck``: nothing while the bytes land
    (the format has no digest of a part of a tensor), every tensor at the end
    (``error``)."""

    # The engine hands landed pieces only to a sink that hashes them.
    takes_pieces = False

    def __init__(
        self,
        check: LlamaCheck,
        index: WeightIndex,
        files: Sequence[ByteSource],
        images: Sequence[Image | None],
        layouts: Sequence[BufferLayout],
        slots: Mapping[str, TensorSlot],
        *,
        swapped: bool,
    ) -> None:
        self._check = check
        self._index = index
        # A lazy tensor's bytes are not loaded: checking it would read them.
        self._loaded = {n for lay in layouts if not lay.plan.lazy for n in lay.plan.tensors}
        self._files = files
        self._images = images
        self._slots = slots
        self._swapped = swapped
        self.hashed = 0  # blocks hashed: this format has none
        self.tensors_hashed = 0

    def __call__(self, job: ReadJob, file_offset: int, piece: memoryview) -> None:
        """Not a piece sink (``takes_pieces``): nothing to do."""

    def check_from_file(self, job: ReadJob) -> None:
        """Nothing per job: each tensor is hashed whole, at the end."""

    def error(self, path: str | None) -> IntegrityError | None:
        """Blocking, once the reads are done: hash every tensor that has a line; the
        ``IntegrityError`` naming every one that differs (None: all good)."""
        failures: list[TensorFailure] = []
        for t in self._index.tensors:  # file order
            line = self._check.lines.get(t.name)
            if line is None or t.name not in self._loaded:
                continue
            state = _NEW[line.algorithm]()
            slot = None if self._swapped else self._slots.get(t.name)
            file = self._files[t.file_index]
            for chunk in tensor_chunks(slot, self._images, file, t.offset, t.nbytes):
                state.update(chunk)
            self.tensors_hashed += 1
            if state.hexdigest() != line.digest:
                failures.append(
                    TensorFailure(
                        name=t.name,
                        type_name=t.type.name,
                        problem=(
                            f"its {line.algorithm} differs from line {line.number} of "
                            f"{os.path.basename(self._check.path)}"
                        ),
                        first_index=None,
                        count=0,
                    )
                )
        return IntegrityError(failures, path) if failures else None
