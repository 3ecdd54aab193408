"""The load server's model manager: what it costs to load a model again, which idle
models to evict for a new load, and when an idle model's keep-alive ends.

The policy (docs/server.md, "The model manager"): a model that is ready, leased by no
client and not pinned may be evicted; the cheapest to reload goes first, where

    reload_s = bytes / rate

``rate`` is the model's own last load rate where it was measured over enough bytes, else
the rate this server has measured for loads from the same kind of source (``cache``: the
files were in the page cache; ``disk``: they were not; ``remote``), else a default for
that kind. Ties (within 1%) go to the least recently used. Only as many are evicted as
the new load needs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Protocol, TypeVar

__all__ = [
    "DEFAULT_RATES",
    "MIN_RATE_BYTES",
    "Evictable",
    "ReloadRates",
    "SourceKind",
    "choose_victims",
    "keep_alive_json",
    "source_kind",
    "wall_clock_iso",
]


class SourceKind(StrEnum):
    """Where a load's bytes came from, as far as its speed goes."""

    CACHE = "cache"  # local files, (nearly) all in the page cache when the load began
    DISK = "disk"  # local files read from the disk
    REMOTE = "remote"  # https:// or hf://


# Before this server has measured any load of a kind: a page-cache copy on one socket,
# an NVMe read, a fast link to a hub. Rough on purpose: they only rank models until
# the first load of each kind is measured.
DEFAULT_RATES: dict[SourceKind, float] = {
    SourceKind.CACHE: 4e9,
    SourceKind.DISK: 1e9,
    SourceKind.REMOTE: 1e8,
}
# A load of fewer bytes says more about its fixed costs (parsing, threads) than about
# its source's rate: it teaches the server nothing.
MIN_RATE_BYTES = 64 * 1024**2
# A file whose bytes are at least this much in the page cache counts as cached.
CACHED_FRACTION = 0.9
# How much a new measurement moves a kind's rate: the last few loads, not one.
_WEIGHT = 0.5


def source_kind(remote: bool, cached_bytes: int | None, nbytes: int) -> SourceKind:
    """The kind of source of a load of ``nbytes`` file bytes, ``cached_bytes`` of them in
    the page cache as it began (None: not known)."""
    if remote:
        return SourceKind.REMOTE
    if cached_bytes is not None and cached_bytes >= CACHED_FRACTION * nbytes:
        return SourceKind.CACHE
    return SourceKind.DISK


class ReloadRates:
    """The load rates (bytes per second) this server has measured, per kind of source:
    a moving mean of its completed loads, a default until the first."""

    def __init__(self) -> None:
        self._rates: dict[SourceKind, float] = {}

    def record(self, kind: SourceKind, nbytes: int, seconds: float) -> float | None:
        """Learn from a completed load; its rate, or None when it was too small or too
        quick to measure anything."""
        if nbytes < MIN_RATE_BYTES or not seconds > 0:
            return None
        rate = nbytes / seconds
        old = self._rates.get(kind)
        self._rates[kind] = rate if old is None else (1 - _WEIGHT) * old + _WEIGHT * rate
        return rate

    def rate(self, kind: SourceKind) -> float:
        """Bytes per second a load of this kind is expected to move."""
        return self._rates.get(kind, DEFAULT_RATES[kind])

    def measured(self) -> dict[str, float]:
        """The kinds measured so far and their rates."""
        return {kind.value: rate for kind, rate in self._rates.items()}

    def reload_seconds(self, nbytes: int, kind: SourceKind, own_rate: float | None) -> float:
        """The estimated time to load ``nbytes`` again: at the model's own last rate
        where measured, else at this kind's."""
        rate = own_rate if own_rate is not None and own_rate > 0 else self.rate(kind)
        return nbytes / rate


class Evictable(Protocol):
    """What the policy reads of a model it may evict."""

    @property
    def nbytes(self) -> int: ...
    @property
    def reload_s(self) -> float: ...
    @property
    def last_used(self) -> float: ...


@dataclass(frozen=True, slots=True)
class _Ranked:
    index: int
    nbytes: int
    reload_s: float
    last_used: float


_T = TypeVar("_T", bound=Evictable)


def choose_victims(candidates: Sequence[_T], free_bytes: int, free_models: int) -> list[_T] | None:
    """The models to evict so that ``free_bytes`` bytes and ``free_models`` models are
    freed, cheapest to reload first (ties within 1% to the least recently used), none of
    them needless; None when evicting every candidate would not be enough.

    ``candidates`` are the idle, unpinned, ready models."""
    if free_bytes <= 0 and free_models <= 0:
        return []
    ranked = sorted(
        (_Ranked(i, c.nbytes, c.reload_s, c.last_used) for i, c in enumerate(candidates)),
        key=lambda r: (_cost_bucket(r.reload_s), r.last_used),
    )
    chosen: list[_Ranked] = []
    freed = 0
    for r in ranked:
        if freed >= free_bytes and len(chosen) >= free_models:
            break
        chosen.append(r)
        freed += r.nbytes
    if freed < free_bytes or len(chosen) < free_models:
        return None
    # A cheap model taken early may turn out needless once a bigger one was taken too:
    # drop those, cheapest first, while the rest still free enough.
    for r in list(chosen):
        if freed - r.nbytes >= free_bytes and len(chosen) - 1 >= free_models:
            chosen.remove(r)
            freed -= r.nbytes
    return [candidates[r.index] for r in chosen]


def _cost_bucket(reload_s: float) -> int:
    # Estimates within 1% of each other are the same cost: recency decides between them.
    if reload_s <= 0:
        return -(2**62)
    return math.floor(math.log(reload_s) / math.log1p(0.01))


def keep_alive_json(seconds: float) -> float:
    """A keep-alive as the API shows it: seconds, ``-1`` for forever (ollama's form)."""
    return -1 if math.isinf(seconds) else seconds


def wall_clock_iso(monotonic: float) -> str:
    """A ``time.monotonic`` instant as a wall-clock ISO 8601 time in UTC."""
    at = time.time() + (monotonic - time.monotonic())
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="milliseconds")
