"""Loading from a URL (``http://``, ``https://``) or the hub (``hf://``, resolved by
``aiogguf.hub`` to a URL): everything a remote file does differently from a local one,
in one place, for the engine.

A remote file is one ``HttpSource`` (``aiogguf.io.http_source``), opened once by the
load's front and kept by its ``LoadResources`` like a ``DataFile``: the header is parsed
from its ranged reads, which grow until the header is complete, and the read and
validate stages read it as any ``ByteSource``. What a local file has and a URL has not
is skipped here: there is nothing to map and no ``O_DIRECT`` (mode ``auto`` is ``none``,
``mmap``/``mlock``/``direct`` are refused), no disk to find (the reader count is
``remote_readers``), no ``fadvise``. A split set named by a URL is refused for now.
"""

from __future__ import annotations

from collections.abc import Sequence

from aiogguf.config import Config
from aiogguf.errors import LoadError, PathNotAllowedError, SplitError
from aiogguf.hub import is_hub_name, resolve_hub_file
from aiogguf.io.http_source import HttpSource, RemoteOptions, is_url, redact_url
from aiogguf.io.opener import AnyPathOpener, FileOpener
from aiogguf.records import ParsedFile, WeightIndex
from aiogguf.stages.index import build_index
from aiogguf.stages.parse import is_split, read_header_from
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


def open_remote(url: str, config: Config) -> HttpSource:
    """Blocking: ``url`` opened (its first request: size and ETag); an ``hf://`` name
    is resolved first, and its file must have the size the hub gave."""
    pipeline = config.pipeline
    options = RemoteOptions(retries=pipeline.remote_retries, stall_s=pipeline.remote_timeout)
    if not is_hub_name(url):
        return HttpSource(url, options)
    found = resolve_hub_file(url)
    headers = {"Authorization": f"Bearer {found.token}"} if found.token else None
    options = RemoteOptions(options.retries, options.backoff_s, options.stall_s, headers)
    source = HttpSource(found.url, options, name=found.name)
    if found.size is not None and source.size_bytes != found.size:
        source.close()
        raise LoadError(
            found.name, None, f"the hub says {found.size} bytes, its file has {source.size_bytes}"
        )
    return source


def read_remote_model(source: HttpSource) -> tuple[ParsedFile, WeightIndex]:
    """Blocking: the header of ``source``, parsed from growing ranged reads, and its
    index. Raises ``SplitError`` for a split set (not loaded from URLs yet)."""
    first = read_header_from(source.path, source.size_bytes, source.read_upto)
    if is_split(first):
        raise SplitError(source.path, "a split set cannot be loaded from a URL yet")
    return first, build_index((first,))


def remote_disks(files: Sequence[object], config: Config) -> Disks:
    """The reader limit of remote files: ``remote_readers`` per host."""
    return Disks(
        tuple(f"remote {f.host}" if isinstance(f, HttpSource) else "?" for f in files),
        tuple(config.pipeline.remote_readers for _ in files),
    )
