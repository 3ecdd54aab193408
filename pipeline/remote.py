"""Loading from a URL (``http://``, ``https://``) or the hub (``hf://``, resolved by
``aiogguf.hub`` to a URL): everything a remote file does differently from a local one,
in one place, for the engine.

A remote file is one ``HttpSource`` (``aiogguf.io.http_source``), opened once by the
load's front and kept by its ``LoadResources`` like a ``DataFile``: the header is parsed
from its ranged reads, which grow until the header is complete, and the read and
validate stages read it as any ``ByteSource``. What a local file has and a URL has not
is skipped here: there is nothing to map and no ``O_DIRECT`` (mode ``auto`` is ``none``,
``mmap``/``mlock``/``direct`` are refused), no disk to find (the reader count is
``remote_readers``), no ``fadvise``. A split set is named by its first split, as
locally; the others are opened and parsed one after the other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from aiogguf.config import Config
from aiogguf.errors import LoadError, PathNotAllowedError, SplitError
from aiogguf.hub import is_hub_name, parse_hub_name, resolve_hub_file
from aiogguf.io.http_source import HttpSource, RemoteOptions, is_url, redact_url
from aiogguf.io.opener import AnyPathOpener, FileOpener
from aiogguf.io.workers import raise_if_stopped
from aiogguf.records import ParsedFile, WeightIndex
from aiogguf.stages.index import build_index
from aiogguf.stages.parse import SPLIT_MAX_COUNT, is_split, read_header_from, split_paths
from aiogguf.stages.read import Disks

__all__ = ["is_remote", "open_remote", "read_remote_model", "remote_config", "remote_disks"]


def is_remote(path: str) -> bool:
    """True for a name the load reads remotely: ``http(s)://`` or ``hf://``."""
    return is_url(path) or is_hub_name(path)


def remote_config(url: str, config: Config, opener: FileOpener | None) -> Config:
    """``config`` for a load of ``url``: mode ``auto`` becomes ``none``; a mode that
    needs a local file raises ``LoadError``. Only a load that may read any path may read
    a URL: an ``opener`` held to roots (a server's) raises ``PathNotAllowedError``."""
    if opener is not None and not isinstance(opener, AnyPathOpener):
        raise PathNotAllowedError(redact_url(url))
    mode = str(config.load.mode)
    if mode == "auto":
        return config.with_overrides(mode="none")
    if mode != "none":
        raise LoadError(
            redact_url(url), None, f"mode '{mode}' needs a local file; a URL loads with 'none'"
        )
    return config


def open_remote(url: str, config: Config) -> tuple[HttpSource, str]:
    """Blocking: ``url`` opened (its first request: size and ETag), and the name that
    opens the same version (for an ``hf://`` name: pinned to the commit the hub resolved
    it to; the file must have the size the hub gave)."""
    pipeline = config.pipeline
    options = RemoteOptions(retries=pipeline.remote_retries, stall_s=pipeline.remote_timeout)
    if not is_hub_name(url):
        return HttpSource(url, options), url
    found = resolve_hub_file(url)
    headers = {"Authorization": f"Bearer {found.token}"} if found.token else None
    options = RemoteOptions(options.retries, options.backoff_s, options.stall_s, headers)
    source = HttpSource(found.url, options, name=found.name)
    if found.size is not None and source.size_bytes != found.size:
        source.close()
        raise LoadError(
            found.name, None, f"the hub says {found.size} bytes, its file has {source.size_bytes}"
        )
    return source, f"hf://{found.repo_id}/{found.filename}@{found.commit}"


def read_remote_model(
    path: str, config: Config, keep: Callable[[HttpSource], None]
) -> tuple[ParsedFile, WeightIndex]:
    """Blocking: open ``path`` and, for a split set named by its first split, every
    other split (one after the other, each handed to ``keep`` as it opens); parse each
    header from growing ranged reads, and index the model.

    Raises ``SplitError``: ``path`` is a later split, or its set's names cannot be made
    (a URL with a query); what ``open_remote``, the parse and ``build_index`` raise."""
    source, pinned = open_remote(path, config)
    keep(source)
    parsed = [read_header_from(source.path, source.size_bytes, source.read_upto)]
    if is_split(parsed[0]):
        for name in _other_splits(parsed[0], pinned):
            raise_if_stopped()
            other, _ = open_remote(name, config)
            keep(other)
            parsed.append(read_header_from(other.path, other.size_bytes, other.read_upto))
    return parsed[0], build_index(tuple(parsed))


def _other_splits(first: ParsedFile, pinned: str) -> list[str]:
    """The names of the splits after ``first`` (opened as ``pinned``), in order."""
    count, split_no = first.split_int("split.count") or 1, first.split_int("split.no")
    if count > SPLIT_MAX_COUNT:
        raise SplitError(first.path, f"split.count {count} exceeds {SPLIT_MAX_COUNT}")
    if split_no != 0:
        which = "has no split.no" if split_no is None else f"is split {split_no + 1} of {count}"
        raise SplitError(first.path, f"a split set is loaded from its first split; this {which}")
    if is_hub_name(pinned):
        hub = parse_hub_name(pinned)
        at = f"@{hub.revision}" if hub.revision else ""
        names = split_paths(hub.filename, 0, count)
        return [f"hf://{hub.repo_id}/{name}{at}" for name in names[1:]]
    if "?" in pinned or "#" in pinned:
        raise SplitError(first.path, "a split set by URL needs names without a query")
    try:
        return split_paths(pinned, 0, count)[1:]
    except SplitError as exc:  # said of the name without its credentials
        raise SplitError(first.path, exc.problem) from None


def remote_disks(files: Sequence[object], config: Config) -> Disks:
    """The reader limit of remote files: ``remote_readers`` per host."""
    return Disks(
        tuple(f"remote {f.host}" if isinstance(f, HttpSource) else "?" for f in files),
        tuple(config.pipeline.remote_readers for _ in files),
    )
