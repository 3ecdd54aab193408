"""Remote sources in a load server: which ``https://`` and ``hf://`` names clients may
load, and the files of such a load, opened while its request is checked.

A server reads remote files only when its operator says so (``RemoteAccess``):
``hf://`` names with ``--allow-remote hf``, URLs beneath an ``--allow-url-prefix``
(matched on the parsed, normalised URL: ``aiogguf._addresses.UrlPrefix``);
anything else is refused as a path outside the roots is. Every connection such a load
makes, to the hub's endpoint, the file's host and every host a redirect leads to, goes
only to addresses outside the loopback, private, link-local and other internal ranges,
unless a network the operator allowed holds them (``AddressPolicy``): a client cannot
make the server reach its own network (server-side request forgery).

``RemoteFiles`` opens a request's files before the load is admitted, as ``PreOpened``
does for local ones: each file's first request learns its size (every split of a set
named by its first), so the server's byte budget counts what the load will hold before
a byte of the model is read, and the load then reads those very sources, at the version
(ETag, commit) that was counted. A request whose client goes away meanwhile closes
them, the one being opened included, from the loop's thread: its request ends at once.
Such a load neither reads nor writes the hub's cache (``aiogguf.remote._hub_cache``): its opener
opens no local file, and a client must not fill the server's disk.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass

from aiogguf._addresses import (
    ALL_NETWORKS,
    AddressPolicy,
    IPNetwork,
    UrlPrefix,
    parse_network,
    url_refusal,
)
from aiogguf._config import Config, ServerConfig
from aiogguf.errors import LoadError, PathNotAllowedError, SplitError
from aiogguf.remote._http_source import HttpSource, is_url, redact_url
from aiogguf.remote._hub import is_hub_name, parse_hub_name
from aiogguf.remote._sources import open_remote, split_names
from aiogguf.stages.parse import split_count_from_name

__all__ = ["NoLocalFiles", "RemoteAccess", "RemoteFiles", "remote_file_count"]

# The hub's default endpoint, as ``huggingface_hub`` has it without ``HF_ENDPOINT``.
_HUB_ENDPOINT = "https://huggingface.co"


@dataclass(frozen=True, slots=True)
class RemoteAccess:
    """Which remote names a server's clients may load, and where its loads may connect.

    ``hub``: ``hf://`` names. ``prefixes``: URLs beneath these. ``networks``: addresses
    in these may be connected to even though they are loopback, private or link-local
    (``ALL_NETWORKS``: any address). The default allows nothing remote."""

    hub: bool = False
    prefixes: tuple[UrlPrefix, ...] = ()
    networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def from_settings(
        cls,
        *,
        allow_remote: Iterable[str] = (),
        url_prefixes: Iterable[str] = (),
        private_addresses: bool = False,
        networks: Iterable[str] = (),
    ) -> RemoteAccess:
        """From the flags' (or ``[server]``'s) words: ``allow_remote`` may hold ``"hf"``.
        Raises ``ValueError`` naming a bad source, prefix or network."""
        sources = set(allow_remote)
        if sources - {"hf"}:
            raise ValueError(f"--allow-remote {sorted(sources - {'hf'})[0]!r}: expected 'hf'")
        try:
            parsed = tuple(UrlPrefix.parse(p) for p in url_prefixes)
        except ValueError as exc:
            raise ValueError(f"--allow-url-prefix {exc}") from None
        try:
            named = tuple(parse_network(n) for n in networks)
        except ValueError as exc:
            raise ValueError(f"--allow-network: {exc}") from None
        return cls("hf" in sources, parsed, (*(ALL_NETWORKS if private_addresses else ()), *named))

    @classmethod
    def from_config(cls, server: ServerConfig) -> RemoteAccess:
        """From a config's ``[server]`` section."""
        return cls.from_settings(
            allow_remote=server.allow_remote,
            url_prefixes=server.allow_url_prefixes,
            private_addresses=server.allow_private_addresses,
            networks=server.allow_networks,
        )

    def merged(self, other: RemoteAccess) -> RemoteAccess:
        """What either allows."""
        return RemoteAccess(
            self.hub or other.hub,
            (*self.prefixes, *(p for p in other.prefixes if p not in self.prefixes)),
            (*self.networks, *(n for n in other.networks if n not in self.networks)),
        )

    @property
    def enabled(self) -> bool:
        """Whether any remote name is allowed."""
        return self.hub or bool(self.prefixes)

    @property
    def address_policy(self) -> AddressPolicy:
        return AddressPolicy(self.networks)

    def refusal(self, name: str) -> str | None:
        """Why a load of ``name`` (a URL or an ``hf://`` name) is not allowed, else None."""
        if is_hub_name(name):
            return None if self.hub else "hf:// names are not allowed by this server"
        if not is_url(name):
            return "not a URL"
        problem = url_refusal(name)
        if problem is not None:
            return problem
        if not any(prefix.admits(name) for prefix in self.prefixes):
            return "not beneath a URL prefix this server allows"
        return None

    def warnings(self) -> list[str]:
        """What the operator opened up, one line each (printed when the server starts)."""
        lines = []
        if self.hub:
            lines.append(
                "--allow-remote hf: clients may have this server fetch any hf:// file of "
                "the hub it reaches"
            )
        if self.prefixes:
            shown = ", ".join(p.text for p in self.prefixes)
            lines.append(
                f"--allow-url-prefix: clients may have this server fetch URLs beneath {shown}"
            )
        if set(ALL_NETWORKS) <= set(self.networks):
            lines.append(
                "--allow-private-addresses: remote loads may connect to any address, "
                "loopback, private and link-local ones included (cloud metadata among them)"
            )
        elif self.networks:
            shown = ", ".join(str(n) for n in self.networks)
            lines.append(f"--allow-network: remote loads may connect to {shown}, internal or not")
        return lines


class NoLocalFiles:
    """The opener of a server that serves only remote names: every path is refused."""

    def open(self, path: str) -> int:
        raise PathNotAllowedError(path)


@dataclass(frozen=True, slots=True)
class _Opened:
    source: HttpSource
    pinned: str


class RemoteFiles:
    """The files of one remote load, opened while its request is checked: made at once
    (a split set past ``max_shards`` raises ``SplitError`` before anything is opened),
    then ``open_all()`` (blocking: on the request's thread) makes each file's first request;
    ``size_bytes`` is what they hold. Given to the load as its opener
    (``aiogguf.remote._sources.RemoteOpener``): it hands over each source it opened, once, and
    opens any other file the load names under the same rules. ``close()``, from any
    thread, closes what it still holds and what it is opening (a request in flight
    ends at once: its client went away).

    ``open_all()`` raises ``PathNotAllowedError`` for a name ``access`` refuses or an address
    its policy refuses; what ``open_remote`` raises (``LoadError``, ``SplitError``)."""

    def __init__(self, access: RemoteAccess, path: str, config: Config, max_shards: int) -> None:
        self._access = access
        # Never the hub's cache: a client must not make the server write files of its
        # choosing to the server's disk.
        self._config = config.with_overrides(cache=False)
        self.path = path
        self._lock = threading.Lock()
        self._held: dict[str, _Opened] = {}
        self._opening: set[HttpSource] = set()  # made, first request under way
        self._closed = False
        self.size_bytes: int = 0
        self.files: int = 0
        self._count = remote_file_count(path)
        if self._count > max_shards:  # before anything is opened
            raise SplitError(
                _shown(path),
                f"a split set of {self._count} shards; this server loads at most {max_shards}",
            )

    def open_all(self) -> None:
        """Blocking: every file's first request (each split of a set named by its first),
        in turn. Closes what it opened on failure."""
        try:
            first = self._open(self.path)
            self._keep(self.path, first)
            if self._count > 1:
                for name in split_names(first.pinned, self._count, first.source.path):
                    self._keep(name, self._open(name))
        except BaseException:
            self.close()
            raise

    def _keep(self, name: str, opened: _Opened) -> None:
        with self._lock:
            closed = self._closed
            if not closed:
                self._held[name] = opened
        if closed:  # closed while it was being opened
            opened.source.close()
            raise LoadError(_shown(name), None, "the request's files are closed")
        self.size_bytes += opened.source.size_bytes
        self.files += 1

    def _open(self, name: str) -> _Opened:
        reason = self._access.refusal(name)
        if reason is not None:
            raise PathNotAllowedError(_shown(name), reason)
        policy = self._access.address_policy
        if is_hub_name(name):
            _check_hub_endpoint(policy)
        made: list[HttpSource] = []

        def track(source: HttpSource) -> None:
            made.append(source)
            with self._lock:
                closed = self._closed
                if not closed:
                    self._opening.add(source)
            if closed:
                source.close()  # its first request then fails at once

        try:
            # Only the size and the ETag: a request refused for its size reads no data.
            source, pinned = open_remote(
                name, self._config, policy=policy, head_bytes=1, on_open=track
            )
        finally:
            with self._lock:
                self._opening.difference_update(made)
        return _Opened(source, pinned)

    # -- the load's opener ------------------------------------------------------------

    def open(self, path: str) -> int:
        """A remote load opens no local file."""
        raise PathNotAllowedError(path)

    def open_remote(self, name: str, config: Config) -> tuple[HttpSource, str]:
        """The source opened for ``name`` at the request (now the load's to close), or
        one opened now under the same rules."""
        with self._lock:
            if self._closed:
                raise LoadError(_shown(name), None, "the request's files are closed")
            opened = self._held.pop(name, None)
        if opened is None:
            opened = self._open(name)
        return opened.source, opened.pinned

    def close(self) -> None:
        """Close the sources no load has taken, and those being opened; idempotent."""
        with self._lock:
            self._closed = True
            held, self._held = self._held, {}
            opening, self._opening = self._opening, set()
        for opened in held.values():
            opened.source.close()
        for source in opening:
            source.close()


def _shown(name: str) -> str:
    return name if is_hub_name(name) else redact_url(name)


def remote_file_count(name: str) -> int:
    """How many files a load of ``name`` opens: every split of a set named by its first
    (``-00001-of-00003.gguf``), else one."""
    file_name = _file_name(name)
    count = split_count_from_name(file_name)
    return count if file_name.endswith(f"-00001-of-{count:05d}.gguf") else 1


def _file_name(name: str) -> str:
    """The file name a remote name ends in (no revision, query or fragment)."""
    if is_hub_name(name):
        return parse_hub_name(name).filename
    return urllib.parse.urlsplit(name).path


def _check_hub_endpoint(policy: AddressPolicy) -> None:
    """The hub's endpoint is reached by ``huggingface_hub``, which resolves its host
    itself: every address the host has must be allowed. (The endpoint is the
    operator's ``HF_ENDPOINT``; the file itself is read through ``HttpSource``, which
    checks each address it connects to, the CDN's included.)"""
    endpoint = os.environ.get("HF_ENDPOINT") or _HUB_ENDPOINT
    parts = urllib.parse.urlsplit(endpoint)
    host = parts.hostname or ""
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, ValueError) as exc:
        raise LoadError(redact_url(endpoint), None, f"the hub's endpoint: {exc}") from exc
    addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
    reason = policy.check_host(host, addresses)
    if reason is not None:
        raise PathNotAllowedError(redact_url(endpoint), f"the hub's endpoint: {reason}")
