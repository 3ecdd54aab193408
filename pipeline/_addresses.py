"""What a server lets its clients fetch: URL prefixes matched on parsed URLs, and the
addresses a remote load may connect to (no server-side request forgery).

- **Prefixes.** ``UrlPrefix.parse("https://models.example/org/")`` admits URLs of that
  scheme, host and port whose path lies beneath ``/org`` on a segment boundary. Both
  sides are parsed and normalised the same way (scheme and host lowercased, the default
  port made explicit, an IP literal in its one written form, each path segment
  percent-decoded once); a URL with credentials (``https://models.example@evil/``), a
  ``.`` or ``..`` segment (written or encoded), an encoded ``/`` or ``\\``, a ``%`` left
  after decoding, a backslash or a control character is refused, not matched.
- **Addresses.** ``AddressPolicy`` is the check ``HttpSource`` runs on every address it
  is about to connect to, after resolving the host once (the address checked is the
  address connected to: a name that resolves to another address a moment later changes
  nothing). Loopback, private (RFC 1918, ``fc00::/7``), link-local (``169.254/16``, the
  cloud metadata address among them, ``fe80::/10``), unspecified, multicast, shared
  (CGNAT, ``100.64/10``), reserved and documentation ranges are refused unless a network
  of ``allowed`` holds the address; an IPv6 address that embeds an IPv4 one (mapped,
  NAT64, 6to4) is judged by that.
"""

from __future__ import annotations

import ipaddress
import re
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "ALL_NETWORKS",
    "AddressPolicy",
    "IPAddress",
    "IPNetwork",
    "UrlPrefix",
    "blocked_reason",
    "checked_network",
    "checked_prefix",
    "is_remote",
    "parse_network",
    "url_refusal",
]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Ranges no model store lives in, with what each is: a remote load never connects there
# unless the operator names a network holding the address.
_BLOCKED: tuple[tuple[IPNetwork, str], ...] = tuple(
    (ipaddress.ip_network(net), what)
    for net, what in (
        ("0.0.0.0/8", "an unspecified address"),
        ("10.0.0.0/8", "a private address"),
        ("100.64.0.0/10", "a shared (CGNAT) address"),
        ("127.0.0.0/8", "a loopback address"),
        ("169.254.0.0/16", "a link-local address (cloud metadata lives there)"),
        ("172.16.0.0/12", "a private address"),
        ("192.0.0.0/24", "a reserved address"),
        ("192.0.2.0/24", "a documentation address"),
        ("192.168.0.0/16", "a private address"),
        ("198.18.0.0/15", "a benchmarking address"),
        ("198.51.100.0/24", "a documentation address"),
        ("203.0.113.0/24", "a documentation address"),
        ("224.0.0.0/4", "a multicast address"),
        ("240.0.0.0/4", "a reserved address"),
        ("::/128", "an unspecified address"),
        ("::1/128", "a loopback address"),
        ("::/96", "a reserved address"),  # IPv4-compatible, deprecated
        ("64:ff9b:1::/48", "a private address"),  # local-use NAT64
        ("100::/64", "a reserved address"),  # discard-only
        ("2001::/32", "a reserved address"),  # Teredo: its IPv4 end is obfuscated
        ("2001:db8::/32", "a documentation address"),
        ("fc00::/7", "a private address"),
        ("fe80::/10", "a link-local address"),
        ("fec0::/10", "a private address"),  # site-local, deprecated
        ("ff00::/8", "a multicast address"),
    )
)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")

# Every address: what ``--allow-private-addresses`` allows.
ALL_NETWORKS: tuple[IPNetwork, ...] = (
    ipaddress.ip_network("0.0.0.0/0"),
    ipaddress.ip_network("::/0"),
)


def _embedded_v4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one stands for (mapped, NAT64, 6to4), if any."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address.sixtofour


def blocked_reason(address: IPAddress) -> str | None:
    """What ``address`` is when a remote load must not connect to it (``"a loopback
    address"``), else None."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = _embedded_v4(address)
        if inner is not None:
            return blocked_reason(inner)
        address = ipaddress.IPv6Address(int(address))  # without a zone (``%eth0``)
    for network, what in _BLOCKED:
        if address.version == network.version and address in network:
            return what
    return None


def parse_network(text: str) -> IPNetwork:
    """A network (``10.1.0.0/16``, ``127.0.0.1``, ``fd00::/8``); ``ValueError`` else."""
    try:
        return ipaddress.ip_network(text.strip(), strict=False)
    except ValueError:
        raise ValueError(
            f"expected a network like 10.1.0.0/16 or an address, got {text!r}"
        ) from None


def checked_network(text: str) -> str:
    """``text``, once ``parse_network`` takes it (a config's validator)."""
    parse_network(text)
    return text


def checked_prefix(text: str) -> str:
    """``text``, once ``UrlPrefix.parse`` takes it (a config's validator)."""
    UrlPrefix.parse(text)
    return text


@dataclass(frozen=True, slots=True)
class AddressPolicy:
    """The addresses a remote load may connect to: any but the ranges of
    ``blocked_reason``, and in those only what a network of ``allowed`` holds. Called
    with the host (as the URL names it) and one address it resolved to; returns why the
    address is refused, or None."""

    allowed: tuple[IPNetwork, ...] = ()

    def __call__(self, host: str, address: IPAddress) -> str | None:
        what = blocked_reason(address)
        if what is None:
            return None
        plain = ipaddress.ip_address(str(address).partition("%")[0])
        if any(plain.version == n.version and plain in n for n in self.allowed):
            return None
        return (
            f"{host} resolves to {plain}, {what}, which this server does not connect to "
            "(--allow-private-addresses or --allow-network)"
        )

    def check_host(self, host: str, addresses: Iterable[IPAddress]) -> str | None:
        """Why ``host`` is refused when any of its ``addresses`` is (for a connection
        made by another library, which picks its own), else None."""
        for address in addresses:
            reason = self(host, address)
            if reason is not None:
                return reason
        return None


# A host name as a URL may hold it once lowercased: letters, digits, '-' and '.'.
_HOST_NAME = re.compile(r"[a-z0-9](?:[a-z0-9.-]{0,251}[a-z0-9])?")
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True, slots=True)
class UrlPrefix:
    """An ``http(s)://`` URL prefix, parsed: a URL matches when its scheme, host and
    port are these and its path segments begin with ``segments`` (and go on past them,
    when the prefix ends in ``/``: a directory)."""

    scheme: str
    host: str
    port: int
    segments: tuple[str, ...]
    directory: bool
    text: str  # as the operator wrote it

    @classmethod
    def parse(cls, text: str) -> UrlPrefix:
        """Raises ``ValueError`` saying what is wrong with ``text`` as a prefix."""
        scheme, host, port, segments, query = _parse_url(text)
        if query:
            raise ValueError(f"{text!r}: a prefix has no query or fragment")
        directory = segments[-1] == ""
        return cls(scheme, host, port, segments[:-1] if directory else segments, directory, text)

    def admits(self, url: str) -> bool:
        """Whether ``url`` lies beneath this prefix (False for any URL ``url_parts``
        refuses)."""
        try:
            scheme, host, port, segments, _ = _parse_url(url)
        except ValueError:
            return False
        n = len(self.segments)
        beneath = segments[:n] == self.segments and (len(segments) > n or not self.directory)
        return beneath and (scheme, host, port) == (self.scheme, self.host, self.port)


def url_refusal(url: str) -> str | None:
    """Why ``url`` cannot be matched against prefixes at all (credentials, ``..``, an
    encoded ``/``...), else None."""
    try:
        _parse_url(url)
    except ValueError as exc:
        return str(exc)
    return None


def _parse_url(text: str) -> tuple[str, str, int, tuple[str, ...], bool]:
    """Scheme, host, port, decoded path segments and whether a query or fragment
    follows; ``ValueError`` for anything that is not one plain ``http(s)`` URL."""
    shown = text if len(text) <= 200 else text[:200] + "..."
    if not text.isascii() or any(c <= " " or c in "\\\x7f" for c in text):
        raise ValueError(f"{shown!r}: spaces, backslashes, control or non-ASCII characters")
    parts = urllib.parse.urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise ValueError(f"{shown!r}: expected an http:// or https:// URL")
    if "@" in parts.netloc:
        raise ValueError(f"{shown!r}: credentials in a URL are not allowed")
    try:
        port = parts.port or _DEFAULT_PORTS[scheme]
    except ValueError:
        raise ValueError(f"{shown!r}: not a usable port") from None
    host = _host(parts.hostname or "", shown)
    raw = parts.path or "/"
    if not raw.startswith("/"):
        raise ValueError(f"{shown!r}: expected a path beginning with '/'")
    segments = []
    for piece in raw[1:].split("/"):
        try:
            segment = urllib.parse.unquote(piece, errors="strict")
        except UnicodeDecodeError:
            raise ValueError(f"{shown!r}: a path that does not decode as UTF-8") from None
        if segment in (".", "..") or any(c in segment for c in "/\\%") or "\0" in segment:
            raise ValueError(f"{shown!r}: a path with '.', '..', or an encoded '/', '\\' or '%'")
        segments.append(segment)
    return scheme, host, port, tuple(segments), bool(parts.query or parts.fragment)


def _host(host: str, shown: str) -> str:
    """``host`` in one written form: an IP literal as ``ipaddress`` writes it, a name
    lowercased without a trailing dot."""
    if not host:
        raise ValueError(f"{shown!r}: no host")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return str(address)
    host = host.lower().removesuffix(".")
    if not _HOST_NAME.fullmatch(host) or ".." in host:
        raise ValueError(f"{shown!r}: not a usable host name")
    # "127.1", "0x7f.1", "2130706433": resolvers read these as addresses; no top-level
    # domain begins with a digit.
    if host.rsplit(".", 1)[-1][:1].isdigit():
        raise ValueError(f"{shown!r}: write an IP address in full (a.b.c.d)")
    return host


# The names a load reads remotely, by scheme (any case): URLs and the hub's names.
REMOTE_SCHEMES = ("http://", "https://", "hf://")


def is_remote(path: str) -> bool:
    """True for a name a load reads remotely: ``http(s)://`` or ``hf://`` (a string
    test: which wing reads it is the core's assembler's business)."""
    return path[:8].lower().startswith(REMOTE_SCHEMES)
