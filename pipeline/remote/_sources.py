"""Loading from a URL (``http://``, ``https://``) or the hub (``hf://``, resolved by
``aiogguf.remote._hub`` to a URL): everything a remote file does differently from a local one,
in one place, for the engine.

A remote file is one ``HttpSource`` (``aiogguf.remote._http_source``), opened once by the
load's front and kept by its ``LoadResources`` like a ``DataFile``: the header is parsed
from its ranged reads, which grow until the header is complete, and the read and
validate stages read it as any ``ByteSource``. What a local file has and a URL has not
is skipped here: there is nothing to map and no ``O_DIRECT`` (mode ``auto`` is ``none``,
``mmap``/``mlock``/``direct`` are refused), no disk to find (the reader count is
``remote_in_flight``), no ``fadvise``. A split set is named by its first split, as
locally; the others are opened and parsed at once, ``remote_in_flight`` at a time
(``_SplitOpening``): each costs round trips (a hub resolution, the first request), and a
set then costs about two files' worth of them, not one per split.

An ``hf://`` file is the hub's: ``route_remote`` finds it in the hub's cache (then the
load reads a local file, in any mode), and otherwise its ``HubSource``
(``aiogguf.remote._hub_cache``) checks its digest and writes the cache as it streams
(``expect_reads`` tells it what the reads will land, ``finish_remote`` waits for the
verdict).

A load that may read any path opens URLs itself (``open_remote``); one whose opener is a
``RemoteOpener`` (a server's, ``aiogguf.server._remote``) opens them through it, which
applies the server's rules and hands over what it opened to admit the request (such a
load reads the hub's cache never: its opener opens no local file).
"""

from __future__ import annotations

import functools
import os
import threading
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

from aiogguf._addresses import is_remote
from aiogguf._config import Config, LoadMode
from aiogguf._jobs import ReadJob
from aiogguf._records import ParsedFile, WeightIndex
from aiogguf.errors import LoadError, PathNotAllowedError, SplitError
from aiogguf.io.opener import AnyPathOpener, FileOpener
from aiogguf.io.workers import StopLink, Stopped, at_load_priority, raise_if_stopped
from aiogguf.remote._http_source import (
    HEAD_BYTES,
    AddressPolicy,
    HttpSource,
    RemoteOptions,
    is_url,
    redact_url,
)
from aiogguf.remote._hub import HubFile, is_hub_name, parse_hub_name, resolve_hub_file
from aiogguf.remote._hub_cache import Digest, HubSource, cache_entry, find_cached
from aiogguf.stages.index import build_index
from aiogguf.stages.parse import SPLIT_MAX_COUNT, is_split, read_header_from, split_paths

__all__ = [
    "RemoteModel",
    "RemoteOpener",
    "RemoteRoute",
    "file_name",
    "finish_remote",
    "is_remote",
    "open_remote",
    "open_remote_file",
    "open_remote_model",
    "read_remote_model",
    "remote_config",
    "route_remote",
    "split_names",
]


@runtime_checkable
class RemoteOpener(Protocol):
    """An opener that also opens remote files, under its own rules."""

    def open(self, path: str) -> int:
        """As ``FileOpener.open``."""
        ...

    def open_remote(self, name: str, config: Config) -> tuple[HttpSource, str]:
        """As ``open_remote``; raises ``PathNotAllowedError`` for a name it refuses."""
        ...


def remote_config(url: str, config: Config, opener: FileOpener | None) -> Config:
    """``config`` for a load of ``url``: mode ``auto`` becomes ``none``; a mode that
    needs a local file raises ``LoadError``. Only a load that may read any path may read
    a URL, or one whose opener is a ``RemoteOpener``: an ``opener`` held to roots raises
    ``PathNotAllowedError``."""
    if opener is not None and not isinstance(opener, (AnyPathOpener, RemoteOpener)):
        raise PathNotAllowedError(redact_url(url))
    mode = config.load.mode
    if mode is LoadMode.AUTO:
        return config.with_overrides(mode=LoadMode.NONE)
    if mode is not LoadMode.NONE:
        raise LoadError(
            redact_url(url), None, f"mode '{mode}' needs a local file; a URL loads with 'none'"
        )
    return config


@dataclass(frozen=True, slots=True)
class RemoteRoute:
    """Where a remote name is read: ``path`` (a URL or ``hf://`` name, or the hub
    cache's local file) with ``config``; ``remote`` holds what a remote load needs (the
    hub's resolution, when it was asked), None for the cached file."""

    path: str
    config: Config
    remote: RemoteName | None


@dataclass(frozen=True, slots=True)
class RemoteName:
    """A remote name as resolved so far (``hub``: the first file's, if asked), and the
    ``RemoteOpener`` that opens its files, if any."""

    hub: HubFile | None
    opener: RemoteOpener | None = None

    def read_model(
        self, path: str, config: Config, keep: Callable[[HttpSource], None]
    ) -> tuple[ParsedFile, WeightIndex]:
        """``read_remote_model`` with the resolution made so far."""
        return read_remote_model(path, config, keep, self.hub, self.opener)

    def expect_reads(self, files: Sequence[object], jobs: Sequence[Sequence[ReadJob]]) -> None:
        """Tell each hub file which of its bytes the load's reads will land (``jobs``:
        every host and device job): its digest fetches the others itself."""
        for i, f in enumerate(files):
            if isinstance(f, HubSource):
                f.expect(
                    (job.useful_start, job.useful_end)
                    for group in jobs
                    for job in group
                    if job.file_index == i
                )


def route_remote(path: str, config: Config, opener: FileOpener | None) -> RemoteRoute:
    """Blocking (an ``hf://`` name asks the hub which commit it names): the cached file
    when the hub's cache has it (``cache`` on, and a load that may read any path), else
    ``path`` with ``remote_config``'s config."""
    found = None
    if isinstance(opener, RemoteOpener):  # it opened the files already; no local file
        return RemoteRoute(path, remote_config(path, config, opener), RemoteName(None, opener))
    if is_hub_name(path) and config.load.cache:
        remote_config(path, config.with_overrides(mode="none"), opener)  # may it read?
        local, found = find_cached(path, resolve_hub_file)
        if local is not None and (opener is None or isinstance(opener, AnyPathOpener)):
            return RemoteRoute(local, config, None)
    return RemoteRoute(path, remote_config(path, config, opener), RemoteName(found))


def open_remote(
    url: str,
    config: Config,
    found: HubFile | None = None,
    *,
    policy: AddressPolicy | None = None,
    head_bytes: int = HEAD_BYTES,
    on_open: Callable[[HttpSource], None] | None = None,
) -> tuple[HttpSource, str]:
    """Blocking: ``url`` opened (its first request: size, ETag and the first
    ``head_bytes``), and the name that opens the same version (for an ``hf://`` name:
    pinned to the commit the hub resolved it to, or ``found`` when it was; the file must
    have the size the hub gave). ``policy``: the addresses it may connect to
    (``RemoteOptions.address_policy``); ``on_open``: told of the source before its first
    request (``RemoteOptions.on_open``)."""
    options = _remote_options(config, policy, head_bytes, on_open)
    if not is_hub_name(url):
        return HttpSource(url, options), url
    found = found or resolve_hub_file(url)
    if found.token:
        options = replace(options, headers={"Authorization": f"Bearer {found.token}"})
    pinned = f"hf://{found.repo_id}/{found.filename}@{found.commit}"
    if (digest := Digest.of_etag(found.etag)) is not None:
        entry = cache_entry(found) if config.load.cache else None
        hub_source = HubSource(
            found.url, options, name=found.name, size=found.size, digest=digest, entry=entry
        )
        return hub_source, pinned
    source = HttpSource(found.url, options, name=found.name)
    if found.size is not None and source.size_bytes != found.size:
        source.close()
        raise LoadError(
            found.name, None, f"the hub says {found.size} bytes, its file has {source.size_bytes}"
        )
    return source, pinned


def _remote_options(
    config: Config,
    policy: AddressPolicy | None,
    head_bytes: int,
    on_open: Callable[[HttpSource], None] | None = None,
) -> RemoteOptions:
    """How ``config`` reads a remote file (``open_remote``'s arguments)."""
    pipeline = config.pipeline
    return RemoteOptions(
        retries=pipeline.remote_retries,
        stall_s=pipeline.remote_timeout,
        request_bytes=pipeline.remote_request_size,
        address_policy=policy,
        head_bytes=head_bytes,
        min_rate=pipeline.remote_min_rate,
        on_open=on_open,
    )


def read_remote_model(
    path: str,
    config: Config,
    keep: Callable[[HttpSource], None],
    found: HubFile | None = None,
    opener: RemoteOpener | None = None,
) -> tuple[ParsedFile, WeightIndex]:
    """Blocking: open ``path`` (``found``: its hub resolution, when made) and, for a
    split set named by its first split, every other split (``_SplitOpening``: several at
    once); parse each header from growing ranged reads, and index the model. Each file
    is opened by ``opener`` when given, else by ``open_remote``, and handed to ``keep``
    (in split order; those opened by a failed load too).

    Raises ``SplitError``: ``path`` is a later split, or its set's names cannot be made
    (a URL with a query); what ``open_remote``, the parse and ``build_index`` raise (for
    the lowest split that fails)."""
    if opener is not None:
        source, pinned = opener.open_remote(path, config)
    else:
        source, pinned = open_remote(path, config, found)
    keep(source)
    parsed = [read_header_from(source.path, source.size_bytes, source.read_upto)]
    if is_split(parsed[0]):

        def open_one(name: str) -> HttpSource:
            return (opener.open_remote if opener else open_remote)(name, config)[0]

        opening = _SplitOpening(_other_splits(parsed[0], pinned), open_one)
        parsed += opening.run(config.pipeline.remote_in_flight, keep)
    return parsed[0], build_index(tuple(parsed))


@dataclass(slots=True)
class _Split:
    """One split's outcome so far: its source once opened, then its header, or why not."""

    source: HttpSource | None = None
    parsed: ParsedFile | None = None
    error: BaseException | None = None


class _SplitOpening:
    """The later splits of a remote set (``names``, in order) opened by ``open_one`` and
    parsed by a few plain threads of its own, each taking the next split in order.

    Failures are told the same way whatever the scheduling: once split ``i`` fails no
    thread takes another, the splits after ``i`` in flight are stopped (their sockets
    notice within ``POLL_S``), those before it go on, and the error raised is the lowest
    split's. The load's stop reaches the threads through a ``StopLink``; the caller's
    thread waits for them all, so a failed or stopped opening leaves no thread, and
    hands every source opened to ``keep``."""

    def __init__(self, names: Sequence[str], open_one: Callable[[str], HttpSource]) -> None:
        self._names = names
        self._open_one = open_one
        self._splits = [_Split() for _ in names]
        self._lock = threading.Lock()
        self._next = 0  # the next split to take
        self._failed = len(names)  # the lowest split that failed so far
        self._abandoned = False  # the caller left early: every thread stops

    def run(self, in_flight: int, keep: Callable[[HttpSource], None]) -> list[ParsedFile]:
        """Blocking, on the load's thread: every split parsed, at most ``in_flight`` at
        once, in split order; each source opened handed to ``keep``, in split order,
        when every thread has ended. Raises the lowest failed split's error, or
        ``Stopped``."""
        link = StopLink(lambda: self._abandoned)  # the load's stop, for the threads
        threads: list[threading.Thread] = []
        try:
            for n in range(min(in_flight, len(self._names))):
                thread = threading.Thread(
                    target=self._serve, args=(link,), name=f"aiogguf-split-{n}", daemon=True
                )
                thread.start()
                threads.append(thread)
            for thread in threads:
                while thread.is_alive():
                    raise_if_stopped()
                    thread.join(_WAIT_S)
        except BaseException:
            self._abandoned = True
            for thread in threads:
                thread.join()  # stopped: within ``POLL_S`` (a hub resolution: its timeout)
            raise
        finally:
            for split in self._splits:
                if split.source is not None:
                    keep(split.source)
        raise_if_stopped()  # the threads may have seen the stop first
        errors = [s.error for s in self._splits if s.error is not None]
        if errors:  # a stopped split's ``Stopped`` only with a real error before it
            raise next((e for e in errors if not isinstance(e, Stopped)), errors[0])
        return [s.parsed for s in self._splits if s.parsed is not None]

    def _serve(self, link: StopLink) -> None:
        """One thread: split after split, until none is left or the opening ends."""
        at_load_priority()
        link.run(functools.partial(self._take_splits, link))

    def _take_splits(self, link: StopLink) -> None:
        while (i := self._take(link)) is not None:
            split = self._splits[i]
            try:
                # Made here: stopped with the opening's link, and once a lower split fails.
                StopLink(functools.partial(self._after_failure, i)).run(
                    functools.partial(self._open_and_parse, self._names[i], split)
                )
            except BaseException as exc:  # the caller's thread raises it
                split.error = exc
                if not isinstance(exc, Stopped):
                    with self._lock:
                        self._failed = min(self._failed, i)

    def _take(self, link: StopLink) -> int | None:
        """The next split to open, or None: all taken, one failed, or the opening stops."""
        with self._lock:
            if self._next >= len(self._names) or self._failed < len(self._names):
                return None
            if link.stopped:
                return None
            self._next += 1
            return self._next - 1

    def _after_failure(self, i: int) -> bool:
        return self._failed < i

    def _open_and_parse(self, name: str, split: _Split) -> None:
        source = split.source = self._open_one(name)
        split.parsed = read_header_from(source.path, source.size_bytes, source.read_upto)


# How long the load's thread waits for the split threads between checks of its stop.
_WAIT_S = 0.1


def _other_splits(first: ParsedFile, pinned: str) -> list[str]:
    """The names of the splits after ``first`` (opened as ``pinned``), in order."""
    count, split_no = first.split_int("split.count") or 1, first.split_int("split.no")
    if count > SPLIT_MAX_COUNT:
        raise SplitError(first.path, f"split.count {count} exceeds {SPLIT_MAX_COUNT}")
    if split_no != 0:
        which = "has no split.no" if split_no is None else f"is split {split_no + 1} of {count}"
        raise SplitError(first.path, f"a split set is loaded from its first split; this {which}")
    return split_names(pinned, count, first.path)


def split_names(pinned: str, count: int, shown: str) -> list[str]:
    """The names of the ``count - 1`` splits after the one opened as ``pinned`` (a URL,
    or an ``hf://`` name at a commit), in order; ``SplitError`` naming ``shown`` when
    they cannot be made."""
    if is_hub_name(pinned):
        hub = parse_hub_name(pinned)
        at = f"@{hub.revision}" if hub.revision else ""
        names = split_paths(hub.filename, 0, count)
        return [f"hf://{hub.repo_id}/{name}{at}" for name in names[1:]]
    if "?" in pinned or "#" in pinned:
        raise SplitError(shown, "a split set by URL needs names without a query")
    try:
        return split_paths(pinned, 0, count)[1:]
    except SplitError as exc:  # said of the name without its credentials
        raise SplitError(shown, exc.problem) from None


def finish_remote(files: Sequence[object]) -> None:
    """Blocking, once every read has landed: each hub file's digest checked
    (``IntegrityError``) and its cache entry committed."""
    for f in files:
        if isinstance(f, HubSource):
            f.finish()


# --- a look at a remote model, or a hash of it ------------------------------------------


@dataclass(slots=True)
class RemoteModel:
    """A remote name opened for a look at its headers or a hash of every byte: either
    ``local``, the hub cache's file to read instead (nothing open), or its ``files`` in
    split order with their ``index``. ``config``: the route's (mode ``auto`` is ``none``
    for a URL). ``close`` it, on a thread (a hub file records what its cache holds)."""

    config: Config
    local: str | None = None
    files: list[HttpSource] = field(default_factory=list)
    index: WeightIndex | None = None

    def finish(self) -> None:
        """Blocking, once every byte was read: each hub file's digest checked against
        the hub's (``IntegrityError``) and its cache entry committed."""
        finish_remote(self.files)

    def close(self) -> None:
        for f in self.files:
            f.close()


def open_remote_model(
    path: str, config: Config, opener: FileOpener | None, *, whole: bool = False
) -> RemoteModel:
    """Blocking: the remote model ``path`` (a URL or ``hf://`` name; a split set by its
    first split) opened and its headers parsed and indexed, or the hub cache's file.

    A look (``whole`` False) reads only the headers' ranges: the first request's
    ``HEAD_BYTES``, more only for a larger header; its files are plain ``HttpSource``s
    (no digest, nothing written to the hub's cache). A hash (``whole``: every byte will
    be read, in any order) opens them as a load does: an ``hf://`` file is checked
    against the hub's sha256 at ``finish`` and written to the hub's cache.

    Raises what ``route_remote`` and ``read_remote_model`` raise."""
    route = route_remote(path, config, opener)
    if route.remote is None:
        return RemoteModel(route.config, local=route.path)
    name = route.remote
    model = RemoteModel(route.config)
    try:
        if whole:
            _, model.index = name.read_model(route.path, route.config, model.files.append)
            _expect_whole(model.files)
        else:
            looking = name.opener or _LookOpener(name.hub)
            _, model.index = read_remote_model(
                route.path, route.config, model.files.append, None, looking
            )
    except BaseException:
        model.close()
        raise
    return model


def open_remote_file(path: str, config: Config, opener: FileOpener | None) -> RemoteModel:
    """Blocking: the remote file ``path`` opened to be read whole, a GGUF or not (no
    header parsed, ``index`` None), as ``open_remote_model`` with ``whole`` opens it; or
    the hub cache's file."""
    route = route_remote(path, config, opener)
    if route.remote is None:
        return RemoteModel(route.config, local=route.path)
    name = route.remote
    if name.opener is not None:
        source, _ = name.opener.open_remote(route.path, route.config)
    else:
        source, _ = open_remote(route.path, route.config, name.hub)
    model = RemoteModel(route.config, files=[source])
    _expect_whole(model.files)
    return model


def file_name(path: str) -> str:
    """The name a manifest gives the file ``path`` (a local path, a URL or an ``hf://``
    name): its last part, without a URL's escapes or an ``hf://`` name's revision."""
    if is_hub_name(path):
        return os.path.basename(parse_hub_name(path).filename)
    if is_url(path):
        return os.path.basename(urllib.parse.unquote(urllib.parse.urlsplit(path).path))
    return os.path.basename(path)


def _expect_whole(files: Sequence[HttpSource]) -> None:
    """Each hub file will have every byte read: its digest fetches nothing itself."""
    for f in files:
        if isinstance(f, HubSource):
            f.expect([(0, f.size_bytes)])


@dataclass(frozen=True, slots=True)
class _LookOpener:
    """Opens a look's remote files: an ``hf://`` name resolved by the hub (the first
    file's resolution ``found``, when made) and read at its commit, with the hub's size,
    but as a plain ``HttpSource``: a look reads a header, not the bytes a digest needs,
    and writes nothing to the hub's cache."""

    found: HubFile | None

    def open(self, path: str) -> int:
        raise PathNotAllowedError(path)  # a remote look opens no local file

    def open_remote(self, name: str, config: Config) -> tuple[HttpSource, str]:
        found = self.found if self.found is not None and self.found.name == name else None
        if not is_hub_name(name):
            return open_remote(name, config)
        found = found or resolve_hub_file(name)
        options = _remote_options(config, None, HEAD_BYTES)
        if found.token:
            options = replace(options, headers={"Authorization": f"Bearer {found.token}"})
        source = HttpSource(found.url, options, name=found.name)
        if found.size is not None and source.size_bytes != found.size:
            source.close()
            raise LoadError(
                found.name,
                None,
                f"the hub says {found.size} bytes, its file has {source.size_bytes}",
            )
        return source, f"hf://{found.repo_id}/{found.filename}@{found.commit}"
