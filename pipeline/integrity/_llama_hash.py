"""llama.cpp's ``llama-gguf-hash`` text format: written, read back, and checked
(format §8.5).

One line per hash: the algorithm left-justified in 8 columns, two spaces, the digest in
lower-case hex, two spaces, the key. A tensor's key is ``FILE:TENSOR`` and its digest is
over the tensor's data bytes only (no padding); the whole-model line's key is ``FILE``
and its digest is over every tensor's data, one after the other in file order. The
algorithms are xxh64 (seed 0), xxh3 (XXH3_64bits), sha1 and sha256, plus ``uuid``: a
UUIDv5 from sha1 over llama.cpp's namespace and the tensor data.

gguf-py's ``gguf_hash`` script (sha1, sha256 and uuid only) leaves out tensors whose
names end in ``.attention.masked_bias``, ``.attention.bias`` or ``.rotary_emb.inv_freq``;
llama.cpp's C tool hashes every tensor. aiogguf writes what gguf-py writes (no line for
such a tensor, none of its bytes in the whole-model digests), and when it checks a
manifest, takes a whole-model digest of either tool. A split set gets the lines of each
shard, as the tools print them one shard at a time.

Reading follows llama.cpp's reader: lines end at a newline, the first three
whitespace-separated fields of each are read, lines of an unknown algorithm (its
``manifest`` header line, a ``- Ok`` column) ignored. Tensors are matched by name, the
file part of the key ignored. The text is checked by regular expressions, each a pass
over it in linear time, and its lines are read one at a time where they are matched,
so that what a manifest holds is its text, whatever its lines are.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shlex
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol

import xxhash

from aiogguf.errors import ManifestError, ManifestMismatchError
from aiogguf.integrity._manifest import MAX_MANIFEST_BYTES
from aiogguf.io.workers import raise_if_stopped

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "ALGORITHMS",
    "GGUF_PY_SKIPPED",
    "LlamaDigests",
    "LlamaHasher",
    "LlamaLine",
    "LlamaManifest",
    "LlamaMismatch",
    "check_llama",
    "format_llama",
    "match_llama",
    "merge_llama",
    "parse_llama",
    "skipped_by_gguf_py",
    "whole_model_only",
]

# In llama-gguf-hash's order; ``uuid`` is a whole-model line only.
ALGORITHMS: Final = ("xxh64", "xxh3", "sha1", "sha256")
UUID: Final = "uuid"
GGUF_PY_SKIPPED: Final = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")
# uuid.uuid5(uuid.NAMESPACE_URL, 'en.wikipedia.org/wiki/Llama.cpp'), as both tools use it.
UUID_NAMESPACE: Final = uuid.UUID("ef001206-dadc-5f6d-a15f-3359e577d4e5")
_HEX_DIGITS: Final = {"xxh64": 16, "xxh3": 16, "sha1": 40, "sha256": 64}
# The longest key read: a path (PATH_MAX on Linux is 4096 bytes; Windows' long paths
# 32767 characters), a colon and a tensor name. A longer one is no key the tools wrote.
MAX_KEY_CHARS: Final = (32 << 10) + 64
# The lines a manifest of a model may have: one per tensor and algorithm, one per file
# and algorithm (and uuid), twice over (two tools' lines in one file).
_LINES_PER_TENSOR: Final = 2 * len(ALGORITHMS)
_LINES_PER_FILE: Final = 2 * (len(ALGORITHMS) + 1)
# Every 4096 lines read, a load looks at its stop.
_STOP_EVERY: Final = 4096

# A hash line: an algorithm, a digest and a key, the first three fields of a line.
_SEP: Final = r"[^\S\n]++"
_ALGORITHM: Final = "|".join((*ALGORITHMS, UUID))
_HASH_LINE: Final = re.compile(rf"^[^\S\n]*+({_ALGORITHM}){_SEP}(\S++){_SEP}(\S++)", re.MULTILINE)
_DIGEST_FORM: Final = {
    **{a: f"[0-9a-f]{{{n}}}" for a, n in _HEX_DIGITS.items()},
    UUID: "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
}
# A hash line whose digest is not of its algorithm's form.
_BAD_DIGEST: Final = re.compile(
    r"^[^\S\n]*+(?:"
    + "|".join(rf"{a}{_SEP}(?!{form}(?!\S))" for a, form in _DIGEST_FORM.items())
    + rf")\S++{_SEP}\S",
    re.MULTILINE,
)
# Lines in a manifest: its smallest hash line (``xxh3 DIGEST k``) is 24 characters with
# its newline, so this is room for twice as many as a manifest holds, and it bounds the
# line starts each pass of a regular expression tries.
MAX_LINES: Final = MAX_MANIFEST_BYTES // 12


@functools.cache
def _line_of(algorithms: frozenset[str]) -> re.Pattern[str]:
    """A hash line of one of ``algorithms``."""
    names = "|".join(sorted(algorithms, key=len, reverse=True))
    return re.compile(rf"^[^\S\n]*+({names}){_SEP}\S++{_SEP}\S", re.MULTILINE)


class _Hash(Protocol):
    def update(self, data: Buffer, /) -> None: ...

    def hexdigest(self) -> str: ...


_NEW: Final[Mapping[str, Callable[[], Any]]] = {
    "xxh64": xxhash.xxh64,
    "xxh3": xxhash.xxh3_64,
    "sha1": hashlib.sha1,
    "sha256": hashlib.sha256,
}


def skipped_by_gguf_py(name: str) -> bool:
    """Whether gguf-py's ``gguf_hash`` leaves tensor ``name`` out."""
    return name.endswith(GGUF_PY_SKIPPED)


@dataclass(frozen=True, slots=True)
class LlamaDigests:
    """The digests of one file: per tensor (file order; every tensor, those gguf-py
    leaves out included) and of the whole model. ``model_all``: the whole-model digests
    over every tensor, as llama.cpp's C tool makes them, where they differ from
    gguf-py's (``model``)."""

    file_name: str
    tensors: tuple[tuple[str, Mapping[str, str]], ...]
    model: Mapping[str, str]
    model_all: Mapping[str, str] = field(default_factory=dict)


class LlamaHasher:
    """Streams one file's bytes, in order, into the digests of ``algorithms`` (a subset
    of ``ALGORITHMS`` and ``uuid``). ``tensors``: (name, start, end) file offsets.
    ``part``: ``"tensors"`` or ``"model"`` computes only the per-tensor or only the
    whole-model digests, so that two threads can share the work (``merge_llama``)."""

    def __init__(
        self,
        file_name: str,
        tensors: Sequence[tuple[str, int, int]],
        algorithms: Sequence[str],
        part: Literal["all", "tensors", "model"] = "all",
    ) -> None:
        self.file_name = file_name
        self._algorithms = [a for a in ALGORITHMS if a in algorithms]
        self._uuid = UUID in algorithms
        self._tensors = sorted(tensors, key=lambda t: t[1])
        self._next = 0  # first tensor not finished
        self._per_tensor = part != "model"
        self._open: dict[str, list[_Hash]] = {}
        self._done: list[tuple[str, Mapping[str, str]]] = []
        whole = part != "tensors"
        self._has_skipped = whole and any(skipped_by_gguf_py(t[0]) for t in self._tensors)
        self._model = self._new_model() if whole else []
        self._model_all = self._new_model() if self._has_skipped else []

    def _new_model(self) -> list[_Hash]:
        states: list[_Hash] = [_NEW[a]() for a in self._algorithms]
        if self._uuid:
            h = hashlib.sha1()
            h.update(UUID_NAMESPACE.bytes)
            states.append(h)
        return states

    def update(self, offset: int, data: Buffer) -> None:
        """The file's bytes ``data`` at ``offset``; pieces come in file order."""
        view = memoryview(data)
        end = offset + len(view)
        i = self._next
        while i < len(self._tensors) and self._tensors[i][1] < end:
            name, start, stop = self._tensors[i]
            lo, hi = max(start, offset), min(stop, end)
            if lo < hi:
                part = view[lo - offset : hi - offset]
                states = self._open.get(name)
                if states is None and self._per_tensor:
                    states = self._open[name] = [_NEW[a]() for a in self._algorithms]
                for state in states or ():
                    state.update(part)
                if not skipped_by_gguf_py(name):
                    for state in self._model:
                        state.update(part)
                for state in self._model_all:
                    state.update(part)
            if stop <= end:
                self._finish(name)
                self._next = i + 1
            i += 1

    def _finish(self, name: str) -> None:
        if not self._per_tensor:
            return
        states = self._open.pop(name, None) or [_NEW[a]() for a in self._algorithms]
        digests = {a: s.hexdigest() for a, s in zip(self._algorithms, states, strict=True)}
        self._done.append((name, digests))

    def _model_digests(self, states: Sequence[_Hash]) -> dict[str, str]:
        digests = {a: s.hexdigest() for a, s in zip(self._algorithms, states, strict=False)}
        if self._uuid and states:
            sha1 = states[-1]
            assert isinstance(sha1, type(hashlib.sha1()))
            digests[UUID] = str(uuid.UUID(bytes=sha1.digest()[:16], version=5))
        return digests

    def result(self) -> LlamaDigests:
        """The digests, once every tensor's bytes have been passed to ``update``."""
        for name, _start, _stop in self._tensors[self._next :]:
            if _start == _stop:  # empty tensors at the end: nothing to wait for
                self._finish(name)
        return LlamaDigests(
            file_name=self.file_name,
            tensors=tuple(self._done),
            model=self._model_digests(self._model),
            model_all=self._model_digests(self._model_all) if self._has_skipped else {},
        )


def merge_llama(tensors: LlamaDigests, model: LlamaDigests) -> LlamaDigests:
    """One file's digests from a ``"tensors"`` and a ``"model"`` hasher."""
    return replace(model, tensors=tensors.tensors)


def format_llama(files: Sequence[LlamaDigests]) -> str:
    """The manifest text: per file, its tensors' lines, then its whole-model lines."""
    lines: list[str] = []
    for f in files:
        for name, digests in f.tensors:
            if skipped_by_gguf_py(name):
                continue
            lines += [
                f"{a:<8}  {digests[a]}  {f.file_name}:{name}" for a in ALGORITHMS if a in digests
            ]
        order = (*ALGORITHMS, UUID)
        lines += [f"{a:<8}  {f.model[a]}  {f.file_name}" for a in order if a in f.model]
    return "".join(line + "\n" for line in lines)


@dataclass(frozen=True, slots=True)
class LlamaLine:
    """One hash line of a ``llama-gguf-hash`` manifest (``number`` counts from 1)."""

    algorithm: str
    digest: str
    key: str
    number: int


@dataclass(frozen=True, slots=True)
class LlamaManifest:
    """A ``llama-gguf-hash`` manifest whose every digest is well formed
    (``parse_llama``): its text, whose lines are read again each time they are wanted
    (``lines``). ``path`` names it in messages."""

    text: str
    path: str | None = None

    def lines(self) -> Iterator[LlamaLine]:
        """The hash lines, in order. On a load's thread, a stopped load stops this
        (``raise_if_stopped`` every few thousand lines).

        Raises ``ManifestError`` at a key longer than any path and tensor name."""
        text = self.text
        number, last = 1, 0
        for count, found in enumerate(_HASH_LINE.finditer(text)):
            if not count % _STOP_EVERY:
                raise_if_stopped()
            start = found.start()
            number += text.count("\n", last, start)
            last = start
            if found.end(3) - found.start(3) > MAX_KEY_CHARS:
                raise ManifestError(
                    self.path,
                    f"line {number}",
                    f"a key of {found.end(3) - found.start(3)} characters; "
                    f"at most {MAX_KEY_CHARS} (a path and a tensor name)",
                )
            yield LlamaLine(found[1], found[2], found[3], number)

    @property
    def algorithms(self) -> frozenset[str]:
        """The algorithms its lines give: found in one pass over the text, each search
        going on from the last one's line for the algorithms not seen yet."""
        seen: set[str] = set()
        at = 0
        while len(seen) <= len(ALGORITHMS):
            found = _line_of(frozenset((*ALGORITHMS, UUID)) - seen).search(self.text, at)
            if found is None:
                break
            seen.add(found[1])
            at = found.end()
        return frozenset(seen)


def parse_llama(text: str, path: str | os.PathLike[str] | None = None) -> LlamaManifest:
    """The hash lines of a ``llama-gguf-hash`` manifest.

    Raises ``ManifestError``: too large or of too many lines, a digest that is not what
    its algorithm makes (named by line), or no line of a known algorithm at all."""
    where = None if path is None else os.fspath(path)
    if len(text) > MAX_MANIFEST_BYTES:
        raise ManifestError(where, "", f"more than {MAX_MANIFEST_BYTES} characters")
    if text.count("\n") >= MAX_LINES:
        raise ManifestError(where, "", f"{text.count(chr(10)) + 1} lines; at most {MAX_LINES}")
    bad = _BAD_DIGEST.search(text)
    if bad is not None:
        line = _HASH_LINE.match(text, bad.start())
        assert line is not None
        number = f"line {text.count(chr(10), 0, bad.start()) + 1}"
        digest = text[line.start(2) : min(line.end(2), line.start(2) + 80)]
        raise ManifestError(where, number, f"expected a {line[1]} digest, got {digest!r}")
    if _HASH_LINE.search(text) is None:
        raise ManifestError(where, "", "no xxh64, xxh3, sha1, sha256 or uuid line")
    return LlamaManifest(text, where)


@dataclass(frozen=True, slots=True)
class LlamaMismatch:
    """A line whose digest differs from the model's: a tensor's (``tensor`` set) or a
    file's whole-model line."""

    line: LlamaLine
    file_name: str
    tensor: str | None
    got: str

    def __str__(self) -> str:
        what = f"tensor {self.tensor!r}" if self.tensor else f"the whole of {self.file_name}"
        return f"{what}: {self.line.algorithm} differs (line {self.line.number})"


def _basename(key: str) -> str:
    return key.replace("\\", "/").rsplit("/", 1)[-1]


def _tensor_of(key: str, tensors: Mapping[str, object], longest: int) -> str | None:
    """The tensor a ``FILE:TENSOR`` key names: the longest suffix after a colon that is
    a tensor of the model (file names may hold colons too). ``longest``: the length of
    the longest tensor name; no colon before the key's last ``longest + 1`` characters
    can start one, so a key costs at most that many tries, whatever its length."""
    at = key.find(":", max(0, len(key) - longest - 1))
    while at >= 0:
        if key[at + 1 :] in tensors:
            return key[at + 1 :]
        at = key.find(":", at + 1)
    return None


def match_llama(
    manifest: LlamaManifest,
    tensor_files: Mapping[str, str],
    file_names: Sequence[str],
    manifest_path: str | os.PathLike[str] | None = None,
) -> Iterator[tuple[LlamaLine, str, str | None]]:
    """What each line of ``manifest`` is about, one line at a time: (line, file name,
    tensor name or None for a whole-model line), for a model whose tensors are
    ``tensor_files`` (tensor name → its file's name) and whose files are
    ``file_names``. Needs no digest, so a manifest of another model is refused before
    any data is read. Iterate it to its end: the last check comes there.

    Raises ``ManifestMismatchError``: a key that is neither a tensor nor a file of the
    model, more lines than a manifest of the model holds (as soon as there are), or a
    tensor (or, without tensor lines, a file) that the lines leave out."""

    def refuse(why: str) -> ManifestMismatchError:
        return ManifestMismatchError(manifest_path, "", f"not a manifest of this model: {why}")

    longest = max(map(len, tensor_files), default=0)
    limit = _LINES_PER_TENSOR * len(tensor_files) + _LINES_PER_FILE * len(file_names)
    seen_tensors: set[str] = set()
    seen_files: set[str] = set()
    for count, line in enumerate(manifest.lines(), 1):
        if count > limit:
            raise refuse(
                f"more than {limit} hash lines (at line {line.number}), more than "
                f"{_LINES_PER_TENSOR} per tensor and {_LINES_PER_FILE} per file"
            )
        tensor = None if line.algorithm == UUID else _tensor_of(line.key, tensor_files, longest)
        if tensor is not None:
            seen_tensors.add(tensor)
            yield line, tensor_files[tensor], tensor
            continue
        name = _basename(line.key)
        if name not in file_names and len(file_names) == 1 and ":" not in name:
            name = file_names[0]  # one file, renamed since
        if name not in file_names:
            raise refuse(f"line {line.number} names {line.key[:120]!r}, no tensor or file of it")
        seen_files.add(name)
        yield line, name, None
    if seen_tensors:
        missing = [n for n in tensor_files if n not in seen_tensors and not skipped_by_gguf_py(n)]
        if missing:
            raise refuse(f"it has no line for tensor {missing[0]!r}")
    else:
        missing = [name for name in file_names if name not in seen_files]
        if missing:
            raise refuse(f"it has no line for {missing[0]!r}")


def whole_model_only(
    manifest_path: str | os.PathLike[str], model_path: str | os.PathLike[str]
) -> ManifestError:
    """The refusal of a manifest without tensor lines where each tensor is to be checked
    (a load): what to run instead."""
    command = f"aiogguf verify {shlex.quote(os.fspath(model_path))} --manifest " + shlex.quote(
        os.fspath(manifest_path)
    )
    return ManifestError(
        manifest_path,
        "",
        "it has whole-model lines only (no tensor lines), which a load cannot check: "
        f"run `{command}` instead (aiogguf.verify_model)",
    )


def check_llama(
    manifest: LlamaManifest,
    computed: Sequence[LlamaDigests],
    manifest_path: str | os.PathLike[str] | None = None,
) -> list[LlamaMismatch]:
    """The lines of ``manifest`` whose digests differ from ``computed`` (the model's
    files, hashed for ``manifest.algorithms``). Raises as ``match_llama`` does."""
    tensors = {name: digests for f in computed for name, digests in f.tensors}
    tensor_files = {name: f.file_name for f in computed for name, _ in f.tensors}
    by_name = {f.file_name: f for f in computed}
    about = match_llama(manifest, tensor_files, list(by_name), manifest_path)
    found: list[LlamaMismatch] = []
    for line, file_name, tensor in about:
        if tensor is not None:
            got = tensors[tensor][line.algorithm]
            if got != line.digest:
                found.append(LlamaMismatch(line, file_name, tensor, got))
            continue
        f = by_name[file_name]
        got = f.model[line.algorithm]
        if got != line.digest and f.model_all.get(line.algorithm) != line.digest:
            found.append(LlamaMismatch(line, file_name, None, got))
    return found
