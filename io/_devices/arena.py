"""Device memory that outlives a load: one arena per device, per process.

``cudaMalloc`` and ``cudaFree`` are device-wide synchronisations: each waits for every
stream of the GPU, so a load that allocates its buffers, or a close that frees them,
stalls every other user of the device (a server's inference included) for as long as
their queued work takes. So device memory is allocated once and kept, as pinned staging
slots are (``pool.py``): a load takes its buffers from its device's arena, and closing
the model gives them back to it without a free. A second load of the same model
allocates nothing.

Reuse is safe by construction:

* a block goes back to the arena only when its buffer is closed *and* no array viewing
  it is alive (``DeviceBlock.buffer`` calls back then): the memory of a model still
  open, or of an array kept past its model's close, is never handed out;
* before a block is handed out again, the events recorded behind the last copies of
  every stream that wrote into it (``used_by``) and the device's default stream (the
  block's ``fence``, recorded when it came back; on CUDA the legacy default stream also
  waits for every blocking stream) have completed. Work a user queued on the arrays on
  a non-blocking stream of their own is not seen: it must be synchronised before the
  model is closed (the README says so).

The arena is bounded. It keeps idle memory only while the device can spare it: at most
``cap_bytes`` idle (by default nine tenths of the device's memory), and none while the
device has less than a tenth of its memory free; beyond that, returned blocks are freed.
An allocation that fails first frees every idle block, then tries again. A block serves
a request of at most its size and at least half of it (a big block is not spent on a
small buffer). ``close_device_arenas()`` (``release_device_memory``, also at exit) frees
every idle block; blocks still leased are freed when they come back.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

from aiogguf.errors import LoadError
from aiogguf.io._devices.base import CopyEvent, DeviceBlock, DeviceBuffer, UploadTarget

__all__ = [
    "ArenaGrant",
    "ArenaStats",
    "DeviceArena",
    "close_device_arenas",
    "device_arena",
    "device_arenas",
]

# Sizes are rounded up so that buffers of nearly the same size share blocks: to CUDA's
# own granularity for large allocations, to 512 bytes (CuPy's pool's unit) below it.
_LARGE_BYTES = 2 * 1024**2
_SMALL_UNIT = 512
# The share of the device's memory an arena keeps idle at most, and the share of it that
# must stay free for the arena to keep anything.
_IDLE_SHARE = 0.9
_RESERVE_SHARE = 0.1


def _rounded(nbytes: int) -> int:
    unit = _LARGE_BYTES if nbytes >= _LARGE_BYTES else _SMALL_UNIT
    return max(-(-nbytes // unit) * unit, unit)


@dataclass(eq=False, slots=True)
class _Block:
    raw: DeviceBlock
    nbytes: int
    # Events behind the last copies into it (per stream), and behind the default stream's
    # work when it came back: all must have completed before it is handed out again.
    events: list[CopyEvent] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ArenaGrant:
    """A buffer taken from the arena: ``allocated_bytes`` of it were allocated from the
    device for it (0 when an idle block served it)."""

    buffer: DeviceBuffer
    allocated_bytes: int
    _block: _Block

    def used_by(self, events: Sequence[CopyEvent]) -> None:
        """Record the events behind the last copies of the streams that wrote into the
        buffer: the block is not handed out again before they have completed."""
        self._block.events.extend(events)


@dataclass(frozen=True, slots=True)
class ArenaStats:
    """An arena's state now, and what it did so far."""

    device: str
    blocks: int  # allocations it holds, idle or leased
    held_bytes: int
    idle_blocks: int
    idle_bytes: int
    allocated: int  # allocations made (each a cudaMalloc)
    allocated_bytes: int
    reused: int  # buffers served by an idle block
    freed: int  # blocks given back to the device (each a cudaFree)


class DeviceArena:
    """The device memory of one device, kept across loads. Thread-safe; ``take`` and
    ``release`` block (allocations and frees are device-wide synchronisations)."""

    def __init__(self, target: UploadTarget, cap_bytes: int | None = None) -> None:
        self.target = target
        self.device: str = target.name
        if cap_bytes is None:
            _, total = target.memory()
            cap_bytes = int(total * _IDLE_SHARE)
        self.cap_bytes = cap_bytes
        # Reentrant: blocks come back from finalizers, which a garbage collection can
        # start on a thread that holds the lock.
        self._lock = threading.RLock()
        self._idle: list[_Block] = []  # oldest first
        self._held_bytes = 0
        self._blocks = 0
        self._allocated = 0
        self._allocated_bytes = 0
        self._reused = 0
        self._freed = 0
        self._closed = False

    def take(self, nbytes: int) -> ArenaGrant:
        """A buffer of ``nbytes``: an idle block that fits once every event of its last
        use has completed, else a new allocation (after freeing every idle block, if the
        first try fails).

        Raises ``LoadError`` when the device cannot allocate it."""
        size = _rounded(nbytes)
        with self._lock:
            fitting = [i for i, b in enumerate(self._idle) if size <= b.nbytes <= 2 * size]
            block = (
                self._idle.pop(min(fitting, key=lambda i: self._idle[i].nbytes))
                if fitting
                else None
            )
            if block is not None:
                self._reused += 1
        allocated = 0
        if block is None:
            block = _Block(self._allocate(size), size)
            allocated = size
        else:
            events, block.events = block.events, []
            try:
                for event in events:
                    if not event.query():
                        event.synchronize()
            except BaseException:
                self._free([block])
                raise
        buffer = block.raw.buffer(nbytes, partial(self._returned, block))
        return ArenaGrant(buffer, allocated, block)

    def release(self) -> int:
        """Free every idle block; the bytes freed. Raises the first failure to free one
        (the others are freed all the same)."""
        with self._lock:
            idle, self._idle = self._idle, []
        self._free(idle)
        return sum(b.nbytes for b in idle)

    def close(self) -> None:
        """Free every idle block, and every leased one when it comes back."""
        with self._lock:
            self._closed = True
        self.release()

    def stats(self) -> ArenaStats:
        with self._lock:
            return ArenaStats(
                device=self.device,
                blocks=self._blocks,
                held_bytes=self._held_bytes,
                idle_blocks=len(self._idle),
                idle_bytes=sum(b.nbytes for b in self._idle),
                allocated=self._allocated,
                allocated_bytes=self._allocated_bytes,
                reused=self._reused,
                freed=self._freed,
            )

    # -- internals ----------------------------------------------------------------------

    def _allocate(self, size: int) -> DeviceBlock:
        try:
            raw = self.target.allocate_block(size)
        except LoadError:
            if not self.release():
                raise
            raw = self.target.allocate_block(size)
        with self._lock:
            self._blocks += 1
            self._held_bytes += size
            self._allocated += 1
            self._allocated_bytes += size
        return raw

    def _returned(self, block: _Block) -> None:
        """A block's buffer is closed and unviewed (a finalizer: any thread, any time)."""
        try:
            block.events.append(block.raw.fence())
            keep = not self._closed and self._device_can_spare()
        except Exception:  # a device that cannot say: do not keep what it may need
            keep = False
        excess: list[_Block] = []
        with self._lock:
            if keep and not self._closed:
                self._idle.append(block)
                idle = sum(b.nbytes for b in self._idle)
                while self._idle and idle > self.cap_bytes:
                    victim = self._idle.pop(0)
                    idle -= victim.nbytes
                    excess.append(victim)
            else:
                excess.append(block)
        # A finalizer has nobody to report to: a block that cannot be freed is lost.
        try:
            self._free(excess)
        except Exception:
            return

    def _device_can_spare(self) -> bool:
        free, total = self.target.memory()
        return free >= total * _RESERVE_SHARE

    def _free(self, blocks: list[_Block]) -> None:
        first: Exception | None = None
        for block in blocks:
            try:
                block.raw.free()
            except Exception as exc:  # free the rest; report the first failure
                first = first or exc
            with self._lock:
                self._blocks -= 1
                self._held_bytes -= block.nbytes
                self._freed += 1
        if first is not None:
            raise first


_arenas: dict[int, tuple[UploadTarget, DeviceArena]] = {}
_arenas_lock = threading.Lock()


def device_arena(target: UploadTarget) -> DeviceArena:
    """The arena of ``target`` (created on first use; one per device object)."""
    with _arenas_lock:
        # The entry keeps the device alive, so its id cannot be reused while listed.
        found = _arenas.get(id(target))
        if found is None:
            found = _arenas[id(target)] = (target, DeviceArena(target))
        return found[1]


def device_arenas() -> tuple[DeviceArena, ...]:
    """Every arena of the process."""
    with _arenas_lock:
        return tuple(arena for _, arena in _arenas.values())


def close_device_arenas() -> None:
    """Free the idle memory of every arena and forget them; memory a model still holds is
    freed when it comes back. Raises the first failure to free a block."""
    with _arenas_lock:
        arenas = [arena for _, arena in _arenas.values()]
        _arenas.clear()
    first: Exception | None = None
    for arena in arenas:
        try:
            arena.close()
        except Exception as exc:
            first = first or exc
    if first is not None:
        raise first
