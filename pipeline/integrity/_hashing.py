"""Hashing a model and checking it against a manifest: ``hash_model``, ``verify_model``,
``verify_sha256`` (async), with ``_sync`` twins for code without a loop.

Every file is read once, in order, by the pass of ``aiogguf.integrity._hash_stream`` on threads the
call borrows (``LoadThreads``); the loop's thread only awaits. Parsing and indexing are
a load's own (``open_index``), so a file a load refuses is refused here too.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio

from aiogguf._config import Config
from aiogguf._core.assemble import open_index
from aiogguf._records import WeightIndex
from aiogguf._run import run
from aiogguf.errors import IntegrityError, ManifestError, TensorFailure
from aiogguf.integrity._checker import (
    IntegrityChecker,
    compare_manifests,
    data_end_of,
    header_bytes_of,
    match_manifest,
)
from aiogguf.integrity._hash_stream import FileLayout, FilePass, FileResult, Wanted
from aiogguf.integrity._llama_hash import (
    ALGORITHMS,
    UUID,
    LlamaDigests,
    LlamaManifest,
    check_llama,
    match_llama,
    parse_llama,
)
from aiogguf.integrity._manifest import (
    BLOCK_BYTES,
    Manifest,
    compute_set_id,
    is_json_manifest,
    parse_manifest,
    read_manifest_text,
)
from aiogguf.io.files import open_file
from aiogguf.io.opener import FileOpener, OpenFiles
from aiogguf.io.source import ByteSource
from aiogguf.io.workers import LoadThreads
from aiogguf.remote._http_source import is_url, redact_url
from aiogguf.remote._sources import (
    RemoteModel,
    file_name,
    is_remote,
    open_remote_file,
    open_remote_model,
)

__all__ = [
    "HashProgress",
    "VerifyReport",
    "hash_model",
    "hash_model_llama",
    "hash_model_llama_sync",
    "hash_model_sync",
    "read_any_manifest",
    "verify_model",
    "verify_model_sync",
    "verify_sha256",
    "verify_sha256_sync",
]

# The most lanes a pass runs at once: the reader and two ordered lanes.
LANES = 3
# Called on the loop's thread with (bytes hashed so far, bytes in all).
HashProgress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """A check that passed: how many files and bytes, in how long, against what."""

    files: int
    nbytes: int
    seconds: float
    against: str  # "sha256", "aiogguf manifest", "llama-gguf-hash manifest (sha256, ...)"


def _layouts(index: WeightIndex) -> list[FileLayout]:
    layouts: list[FileLayout] = []
    for i, parsed in enumerate(index.files):
        tensors = sorted(
            (t.name, parsed.data_offset + t.offset, parsed.data_offset + t.offset + t.nbytes)
            for t in parsed.tensors
        )
        layouts.append(
            FileLayout(
                name=file_name(parsed.path),
                size=parsed.file_size,
                header_bytes=header_bytes_of(parsed),
                data_end=data_end_of(parsed),
                tensors=tuple(sorted(tensors, key=lambda t: t[1])),
                file_index=i,
            )
        )
    return layouts


async def _hash_files(
    paths: Sequence[str],
    layouts: Sequence[FileLayout],
    wanted: Wanted,
    threads: LoadThreads,
    files: OpenFiles | RemoteModel,
    progress: HashProgress | None,
) -> list[FileResult]:
    """Each file in one pass (its lanes at once), one file after the other: opened
    through ``files``, or a remote model's, open already (and closed by its owner)."""
    total = sum(layout.size for layout in layouts)
    done = 0

    def on_loop(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    def report(n: int) -> None:
        threads.call_soon(on_loop, n, lazy=True)

    results: list[FileResult] = []
    for i, (path, layout) in enumerate(zip(paths, layouts, strict=True)):
        data: ByteSource
        if isinstance(files, RemoteModel):
            data = files.files[i]
        else:
            data = await threads.run_sync(lambda p=path: open_file(p, fd=files.open(p)))
        try:
            # Its buffers are tens of MiB to fill with zeros: not on the loop's thread.
            one = await threads.run_sync(FilePass, data, layout, wanted, report)
            await _run_lanes(threads, one)
            await threads.run_sync(data.check_unchanged)
        finally:
            if not isinstance(files, RemoteModel):
                with anyio.CancelScope(shield=True):
                    await threads.run_sync(data.close)
        results.append(await threads.run_sync(one.result))
    return results


async def _run_lanes(threads: LoadThreads, one: FilePass) -> None:
    """Run the pass's lanes at once; raise what the first that failed raised."""
    calls = [threads.submit(one.read_lane), *(threads.submit(lane) for lane in one.ordered_lanes)]
    for i, call in enumerate(calls):
        try:
            await threads.wait(call, on_cancel=one.stop)
        except BaseException:
            one.stop()
            with anyio.CancelScope(shield=True):
                for rest in calls[i + 1 :]:
                    with contextlib.suppress(Exception):
                        await threads.wait(rest)
            raise


async def _indexed(
    path: str | os.PathLike[str],
    opener: FileOpener | None,
    wanted: Wanted,
    progress: HashProgress | None,
    check: Callable[[WeightIndex], None] | None = None,
) -> tuple[WeightIndex, list[FileResult]]:
    """Index the model, ``check`` the index, hash every file."""
    files = OpenFiles(opener)
    remote: RemoteModel | None = None
    try:
        async with LoadThreads(LANES, name="aiogguf-hash") as threads:
            fspath = os.fspath(path)
            if is_remote(fspath):
                go = functools.partial(open_remote_model, fspath, Config(), opener, whole=True)
                remote = await threads.run_sync(go)
            if remote is not None and remote.index is not None:
                index = remote.index
            else:
                where = remote.local if remote is not None and remote.local else path
                index = await open_index(where, threads=threads, files=files)
            if check is not None:
                await threads.run_sync(check, index)
            layouts = _layouts(index)
            paths = [f.path for f in index.files]
            source = remote if remote is not None and remote.files else files
            results = await _hash_files(paths, layouts, wanted, threads, source, progress)
            if remote is not None:
                await threads.run_sync(remote.finish)  # a hub file: its digest, the cache
            return index, results
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(files.close)
            if remote is not None:
                await anyio.to_thread.run_sync(remote.close)


def _manifest(block_bytes: int, results: Sequence[FileResult]) -> Manifest:
    file_hashes = tuple(r.file for r in results)
    tensors = tuple(t for r in results for t in r.tensors)
    return Manifest(
        block_bytes=block_bytes,
        files=file_hashes,
        tensors=tensors,
        set_id=compute_set_id(block_bytes, file_hashes, tensors),
    )


async def hash_model(
    path: str | os.PathLike[str],
    *,
    block_bytes: int = BLOCK_BYTES,
    opener: FileOpener | None = None,
    progress: HashProgress | None = None,
) -> Manifest:
    """Hash a model (every split of a set) into its ``Manifest``, reading each file once.

    ``path``: a single-file model or the first split of a set. ``block_bytes``: the
    block size (a power of two; default 16 MiB). ``opener``: as for ``load``.
    ``progress(done, total)``: bytes hashed so far, called on the loop's thread.

    Raises what ``inspect`` raises for the files, and ``LoadError`` if a file cannot be
    read or changes while it is hashed."""
    if block_bytes <= 0 or block_bytes & (block_bytes - 1):
        raise ValueError(f"block_bytes must be a power of two, got {block_bytes}")
    wanted = Wanted(sha256=True, blocks=True, block_bytes=block_bytes)
    _, results = await _indexed(path, opener, wanted, progress)
    return _manifest(block_bytes, results)


async def hash_model_llama(
    path: str | os.PathLike[str],
    *,
    algorithms: Sequence[str] = (*ALGORITHMS, UUID),
    opener: FileOpener | None = None,
    progress: HashProgress | None = None,
) -> tuple[LlamaDigests, ...]:
    """The digests ``llama-gguf-hash`` prints for each file of a model (``format_llama``
    writes them): ``algorithms`` of xxh64, xxh3, sha1, sha256 and uuid. Raises as
    ``hash_model`` does."""
    wanted = Wanted(sha256=False, blocks=False, llama=frozenset(algorithms))
    _, results = await _indexed(path, opener, wanted, progress)
    return tuple(r.llama for r in results if r.llama is not None)


def read_any_manifest(path: str | os.PathLike[str]) -> Manifest | LlamaManifest:
    """Blocking: the manifest at ``path``, aiogguf's JSON or llama-gguf-hash's text
    (told apart by the first character). Raises ``ManifestError``, ``LoadError``."""
    text = read_manifest_text(path)
    if is_json_manifest(text):
        return parse_manifest(text, path)
    return parse_llama(text, path)


async def verify_model(
    path: str | os.PathLike[str],
    manifest: str | os.PathLike[str] | Manifest | LlamaManifest,
    *,
    opener: FileOpener | None = None,
    progress: HashProgress | None = None,
) -> VerifyReport:
    """Check a model against a manifest (a path to one, or one already read), reading
    each file once.

    Raises ``ManifestMismatchError`` (the manifest is of another model, said before any
    data is read where the manifest tells), ``IntegrityError`` naming every tensor whose
    bytes differ (with file, block and offset), ``ManifestError`` for a manifest that
    cannot be read, and what ``hash_model`` raises."""
    started = time.perf_counter()
    manifest_path = None
    if not isinstance(manifest, Manifest | LlamaManifest):
        manifest_path = os.fspath(manifest)
        manifest = await anyio.to_thread.run_sync(read_any_manifest, manifest_path)
    where = _shown(os.fspath(path))
    if isinstance(manifest, Manifest):
        expected = manifest
        wanted = Wanted(sha256=True, blocks=True, block_bytes=manifest.block_bytes)
        index, results = await _indexed(
            path,
            opener,
            wanted,
            progress,
            lambda idx: match_manifest(expected, idx, manifest_path),
        )
        names = [r.file.name for r in results]
        found = compare_manifests(
            expected,
            _manifest(expected.block_bytes, results),
            file_names=names,
            manifest_path=manifest_path,
        )
        if found:
            raise IntegrityChecker(expected, index, file_names=names).error(found, where)
        against = "aiogguf manifest"
    else:
        llama = manifest
        algorithms = llama.algorithms
        wanted = Wanted(sha256=False, blocks=False, llama=algorithms)

        def match(idx: WeightIndex) -> None:
            names = [file_name(f.path) for f in idx.files]
            tensor_files = {t.name: names[t.file_index] for t in idx.tensors}
            for _ in match_llama(llama, tensor_files, names, manifest_path):
                pass

        index, results = await _indexed(path, opener, wanted, progress, match)
        digests = [r.llama for r in results if r.llama is not None]
        mismatches = check_llama(manifest, digests, manifest_path)
        if mismatches:
            failures = [
                TensorFailure(
                    name=m.tensor or f"(all of {m.file_name})",
                    type_name=index[m.tensor].type.name if m.tensor else "-",
                    problem=f"{m.line.algorithm} differs from the manifest (line {m.line.number})",
                    first_index=None,
                    count=0,
                )
                for m in mismatches
            ]
            raise IntegrityError(failures, where)
        against = f"llama-gguf-hash manifest ({', '.join(sorted(algorithms))})"
    nbytes = sum(r.file.size for r in results) or sum(f.file_size for f in index.files)
    return VerifyReport(len(results), nbytes, time.perf_counter() - started, against)


def _shown(path: str) -> str:
    """``path`` for messages: a URL without its credentials or query."""
    return redact_url(path) if is_url(path) else path


def _sha256_hex(text: str) -> str:
    value = text.strip().lower().removeprefix("sha256:")
    if len(value) != 64 or value.strip("0123456789abcdef"):
        raise ManifestError(None, "sha256", f"expected 64 hex digits, got {text[:80]!r}")
    return value


async def verify_sha256(
    path: str | os.PathLike[str],
    sha256: str,
    *,
    opener: FileOpener | None = None,
    progress: HashProgress | None = None,
) -> VerifyReport:
    """Check one file against a sha256 (the hub's LFS oid; ``sha256:`` prefix allowed),
    reading it once. Any file is read whole, a GGUF or not.

    Raises ``IntegrityError`` when the digest differs, ``ManifestError`` for a value
    that is not 64 hex digits, ``LoadError`` for a file that cannot be read."""
    expected = _sha256_hex(sha256)
    started = time.perf_counter()
    fspath = os.fspath(path)
    files = OpenFiles(opener)
    remote: RemoteModel | None = None
    try:
        async with LoadThreads(2, name="aiogguf-hash") as threads:
            source: OpenFiles | RemoteModel = files
            where = fspath
            if is_remote(fspath):
                go = functools.partial(open_remote_file, fspath, Config(), opener)
                remote = await threads.run_sync(go)
                where = remote.local or fspath
                source = remote if remote.files else files
            if isinstance(source, RemoteModel):
                size = source.files[0].size_bytes
            else:
                size = await threads.run_sync(lambda: os.fstat(files.open(where)).st_size)
            layout = FileLayout(file_name(fspath), size, 0, 0, ())
            wanted = Wanted(sha256=True, blocks=False)
            (result,) = await _hash_files([where], [layout], wanted, threads, source, progress)
            if remote is not None:
                await threads.run_sync(remote.finish)
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(files.close)
            if remote is not None:
                await anyio.to_thread.run_sync(remote.close)
    got = result.file.sha256.hex()
    if not hmac.compare_digest(got, expected):
        summary = f"sha256 is {got}, expected {expected}"
        raise IntegrityError((), _shown(fspath), summary=summary)
    return VerifyReport(1, size, time.perf_counter() - started, "sha256")


def hash_model_sync(
    path: str | os.PathLike[str],
    *,
    block_bytes: int = BLOCK_BYTES,
    opener: FileOpener | None = None,
    progress: HashProgress | None = None,
) -> Manifest:
    """``hash_model`` for code without a loop (blocking; runs an event loop of its own)."""
    go = functools.partial(
        hash_model, path, block_bytes=block_bytes, opener=opener, progress=progress
    )
    result: Manifest = run(go)
    return result


def hash_model_llama_sync(
    path: str | os.PathLike[str],
    *,
    algorithms: Sequence[str] = (*ALGORITHMS, UUID),
    opener: FileOpener | None = None,
    progress: HashProgress | None = None,
) -> tuple[LlamaDigests, ...]:
    """``hash_model_llama`` for code without a loop."""
    go = functools.partial(
        hash_model_llama, path, algorithms=algorithms, opener=opener, progress=progress
    )
    result: tuple[LlamaDigests, ...] = run(go)
    return result


def verify_model_sync(
    path: str | os.PathLike[str],
    manifest: str | os.PathLike[str] | Manifest | LlamaManifest,
    *,
    opener: FileOpener | None = None,
    progress: HashProgress | None = None,
) -> VerifyReport:
    """``verify_model`` for code without a loop."""
    go = functools.partial(verify_model, path, manifest, opener=opener, progress=progress)
    result: VerifyReport = run(go)
    return result


def verify_sha256_sync(
    path: str | os.PathLike[str],
    sha256: str,
    *,
    opener: FileOpener | None = None,
    progress: HashProgress | None = None,
) -> VerifyReport:
    """``verify_sha256`` for code without a loop."""
    go = functools.partial(verify_sha256, path, sha256, opener=opener, progress=progress)
    result: VerifyReport = run(go)
    return result
