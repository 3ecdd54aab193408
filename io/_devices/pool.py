"""Staging slots that outlive a load: one pool of pinned host slots per device, per process.

Pinning host memory is the slow part of a GPU upload's set-up (on an H200 host it costs
about a second per GiB, as long as copying several GiB), so slots are pinned once and
kept: every load of the process, and loads running side by side, lease them from the
device's pool and give them back when their copies have completed. The pool grows on
demand up to the cap its callers pass, pins outside its lock (so leases of slots already
pinned never wait behind a pin), and is freed by ``close_staging_pools()`` (also at
exit), which first frees the idle memory of every device arena (``arena.py``) and then
empties the device's cache of freed device memory where it keeps one (``CachedMemory``).

Each slot carries the device event recorded behind the last copy out of it. A slot comes
back to the pool only after its lessee has synchronized the stream that copied out of it,
so a leased slot is always free to fill.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from aiogguf.io._devices.arena import close_device_arenas
from aiogguf.io._devices.base import CachedMemory, CopyEvent, StagingSlot, UploadTarget

__all__ = [
    "PoolStats",
    "PooledSlot",
    "SlotLease",
    "StagingPool",
    "close_staging_pools",
    "staging_pool",
    "staging_pools",
]

# How often a lessee waiting for a slot looks at its stop flag (cancellation latency).
_WAIT_POLL_S = 0.05


@dataclass(slots=True, eq=False)
class PooledSlot:
    """A slot of the pool and the event of the last copy out of it."""

    slot: StagingSlot
    event: CopyEvent
    nbytes: int
    alignment: int


@dataclass(slots=True)
class SlotLease:
    """Slots leased by one transfer thread; ``pinned_bytes``: how many of their bytes were
    pinned for this lease (0 when the pool already held them)."""

    slots: list[PooledSlot] = field(default_factory=list)
    pinned_bytes: int = 0


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A pool's state: what is pinned, and what of it is leased now."""

    device: str
    slots: int
    pinned_bytes: int
    leased_slots: int


class StagingPool:
    """The staging slots of one device. Thread-safe; every method may block."""

    def __init__(self, target: UploadTarget) -> None:
        self.target = target
        self.device: str = target.name
        self._cond = threading.Condition()
        self._idle: list[PooledSlot] = []
        self._leased: set[int] = set()  # ids of leased PooledSlots
        self._pinned_bytes = 0  # pinned now, or being pinned
        self._count = 0
        self._index = itertools.count()

    def lease(
        self,
        count: int,
        nbytes: int,
        alignment: int,
        *,
        cap_bytes: int,
        wait: bool = True,
        pin: bool = True,
        stopped: Callable[[], bool] = lambda: False,
    ) -> SlotLease:
        """Lease between 1 and ``count`` slots of at least ``nbytes`` starting on an
        ``alignment`` boundary, pinning new ones while the pool stays within
        ``cap_bytes`` (one slot is always allowed). Waits while every slot is leased and
        the cap is reached, unless ``wait`` is false; returns an empty lease then, or
        once ``stopped()`` is true. ``pin=False`` takes idle slots only.

        Raises ``LoadError`` when the device cannot pin memory."""
        lease = SlotLease()
        cap_bytes = max(cap_bytes, nbytes) if pin else 0
        while len(lease.slots) < count:
            slot, reserved = self._take_or_reserve(nbytes, alignment, cap_bytes if pin else 0)
            if slot is not None:
                lease.slots.append(slot)
                continue
            if not reserved:
                if lease.slots or not wait or stopped():
                    break  # work with what we have: holding some and waiting could deadlock
                with self._cond:
                    self._cond.wait(_WAIT_POLL_S)
                continue
            try:
                pooled = self._pin(nbytes, alignment)
            except BaseException:
                with self._cond:
                    self._pinned_bytes -= nbytes
                    self._cond.notify_all()
                self.give_back(lease)
                raise
            with self._cond:
                self._leased.add(id(pooled))
                self._count += 1
            lease.slots.append(pooled)
            lease.pinned_bytes += nbytes
        return lease

    def give_back(self, lease: SlotLease) -> None:
        """Return a lease's slots. Every copy out of them must have completed."""
        with self._cond:
            for pooled in lease.slots:
                self._leased.discard(id(pooled))
                self._idle.append(pooled)
            lease.slots = []
            self._cond.notify_all()

    def stats(self) -> PoolStats:
        with self._cond:
            return PoolStats(
                self.device,
                self._count,
                self._pinned_bytes,
                len(self._leased),
            )

    def close(self) -> None:
        """Free every idle slot (call it when no load runs: leased slots stay with their
        lessees), and the device's idle cached memory. Raises the first failure to free
        one."""
        with self._cond:
            idle, self._idle = self._idle, []
            for pooled in idle:
                self._pinned_bytes -= pooled.nbytes
                self._count -= 1
        try:
            _close_slots(idle)
        finally:
            if isinstance(self.target, CachedMemory):
                self.target.release_cached_memory()

    # -- internals ----------------------------------------------------------------------

    def _take_or_reserve(
        self, nbytes: int, alignment: int, cap_bytes: int
    ) -> tuple[PooledSlot | None, bool]:
        """Under the lock: an idle slot that fits, or a reservation of ``nbytes`` to pin
        (``(None, True)``), or neither (``(None, False)``)."""
        evicted: list[PooledSlot] = []
        try:
            with self._cond:
                fitting = [
                    p for p in self._idle if p.nbytes >= nbytes and p.alignment % alignment == 0
                ]
                if fitting:
                    best = min(fitting, key=lambda p: p.nbytes)
                    self._idle.remove(best)
                    self._leased.add(id(best))
                    return best, False
                if not cap_bytes:
                    return None, False
                # Idle slots that do not fit make room for one that does.
                while self._pinned_bytes + nbytes > cap_bytes and self._idle:
                    victim = self._idle.pop()
                    evicted.append(victim)
                    self._pinned_bytes -= victim.nbytes
                    self._count -= 1
                if self._pinned_bytes + nbytes <= cap_bytes:
                    self._pinned_bytes += nbytes
                    return None, True
                return None, False
        finally:
            _close_slots(evicted)

    def _pin(self, nbytes: int, alignment: int) -> PooledSlot:
        slot = self.target.open_staging_slot(next(self._index), nbytes, alignment)
        try:
            event = self.target.new_event()
        except BaseException:
            slot.close()
            raise
        return PooledSlot(slot, event, nbytes, alignment)


def _close_slots(slots: list[PooledSlot]) -> None:
    first: Exception | None = None
    for pooled in slots:
        try:
            pooled.slot.close()
        except Exception as exc:  # free the rest; report the first failure
            first = first or exc
    if first is not None:
        raise first


_pools: dict[int, tuple[UploadTarget, StagingPool]] = {}
_pools_lock = threading.Lock()


def staging_pool(target: UploadTarget) -> StagingPool:
    """The pool of ``target`` (created on first use; one per device object)."""
    with _pools_lock:
        # The entry keeps the device alive, so its id cannot be reused while listed.
        found = _pools.get(id(target))
        if found is None:
            found = _pools[id(target)] = (target, StagingPool(target))
        return found[1]


def staging_pools() -> tuple[StagingPool, ...]:
    """Every pool of the process."""
    with _pools_lock:
        return tuple(pool for _, pool in _pools.values())


def close_staging_pools() -> None:
    """Free the idle device memory of every device arena, every idle slot of every pool
    and the idle cached memory of its device, and forget the arenas and pools. Call it
    when no load runs (a slot leased now stays with its load and is freed with the
    pool's object; device memory a model holds is freed when the model is closed)."""
    first: Exception | None = None
    try:
        close_device_arenas()  # first: the blocks it frees go to a device's cache
    except Exception as exc:
        first = exc
    with _pools_lock:
        pools = [pool for _, pool in _pools.values()]
        _pools.clear()
    for pool in pools:
        try:
            pool.close()
        except Exception as exc:
            first = first or exc
    if first is not None:
        raise first


def _close_at_exit() -> None:
    # At exit the driver may already be shutting down; nothing is left to report to.
    with contextlib.suppress(Exception):
        close_staging_pools()


atexit.register(_close_at_exit)
