"""One load a load server knows (``_Entry``): its task's state and progress, the
subscribers to its event stream, and what the model manager keeps of it (keep-alive,
pin, leases, reload cost). ``aiogguf.server._app``'s registry makes and runs them."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from aiogguf._events import FanOut, Progress
from aiogguf._model import Model
from aiogguf._report import LoadReport
from aiogguf.io._devices.arena import device_arenas
from aiogguf.io._devices.base import Device
from aiogguf.remote._http_source import is_url, redact_url
from aiogguf.remote._sources import is_remote
from aiogguf.server._manager import ReloadRates, keep_alive_json, source_kind, wall_clock_iso
from aiogguf.server._requests import LoadRequest

__all__ = ["LoadState", "load_key"]


class LoadState(StrEnum):
    """Where one load the server knows stands."""

    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    CANCELLED = "cancelled"
    UNLOADED = "unloaded"


class _Entry:
    """One load the server knows: its task's state, progress and subscribers, and what
    the model manager keeps of it (keep-alive, pin, leases, reload cost)."""

    def __init__(
        self,
        load_id: str,
        request: LoadRequest,
        rates: ReloadRates,
        keep_alive_s: float,
    ) -> None:
        self.id = load_id
        self.request = request
        self.rates = rates
        self.state = LoadState.LOADING
        self.queued = True
        self.progress: Progress | None = None
        self.report: LoadReport | None = None
        self.error: str | None = None
        # Cancellable before its task even starts.
        self.scope: anyio.CancelScope = anyio.CancelScope()
        self.unload: anyio.Event = anyio.Event()
        self.finished: anyio.Event = anyio.Event()
        self.holds_memory = True  # loading or ready: counted against the server's limits
        # The model while READY (None otherwise): what attached clients map.
        self.model: Model | None = None
        # Clients attached now (``LoaderRegistry.lease``); a leased model is never
        # evicted or unloaded unless forced.
        self.leases = 0
        # When the model was last ready-and-unleased or used (``time.monotonic``).
        self.last_used = time.monotonic()
        # How long the model stays once idle (``math.inf``: forever), and whether it is
        # pinned: never evicted, never expired, unloaded only by DELETE.
        self.keep_alive_s = keep_alive_s
        self.pinned = bool(request.pin)
        # Its unload was asked for (DELETE, eviction, keep-alive): its memory is on its
        # way out, and a new load waits for it (``after``) rather than overshoot.
        self.leaving = False
        self.unload_reason: str | None = None
        self.after: tuple[_Entry, ...] = ()
        # Where its bytes came from (looked at again as its load begins) and the rate
        # its load measured (None: too small to say): its reload cost.
        self.kind = source_kind(is_remote(request.path), None, request.nbytes)
        self.load_rate: float | None = None
        self._fan = FanOut[dict[str, Any]]()
        # Set (and replaced) whenever subscribers may have something new.
        self.changed: anyio.Event = anyio.Event()

    @property
    def settled(self) -> bool:
        """The load itself has ended: ready, or in a terminal state."""
        return self.state is not LoadState.LOADING

    @property
    def nbytes(self) -> int:
        """File bytes the model holds (or will)."""
        return self.request.nbytes

    @property
    def reload_s(self) -> float:
        """The estimated time to load this model again (docs/server.md)."""
        return self.rates.reload_seconds(self.request.nbytes, self.kind, self.load_rate)

    @property
    def evictable(self) -> bool:
        """Ready, idle (no lease), not pinned, and not on its way out already."""
        return (
            self.state is LoadState.READY
            and self.leases == 0
            and not self.pinned
            and not self.leaving
        )

    def deadline(self) -> float | None:
        """When an idle model's keep-alive ends (``time.monotonic``); None while it is
        loading, leased, pinned, kept forever or leaving."""
        if not self.evictable or math.isinf(self.keep_alive_s):
            return None
        return self.last_used + self.keep_alive_s

    def snapshot(self) -> dict[str, Any]:
        """The load's state and progress, as the server sends it (JSON)."""
        p = self.progress
        gbps = p.gbps if p is not None else math.nan
        data: dict[str, Any] = {
            "id": self.id,
            # Without a signed URL's query: every client may list every load.
            "path": redact_url(self.request.path)
            if is_url(self.request.path)
            else self.request.path,
            "state": self.state.value,
            "queued": self.queued and self.state is LoadState.LOADING,
            "stage": p.stage.value if p is not None else None,
            "bytes_done": p.bytes_done if p is not None else 0,
            "bytes_total": p.bytes_total if p is not None else 0,
            "tensors_done": p.tensors_done if p is not None else 0,
            "tensors_total": p.tensors_total if p is not None else 0,
            "elapsed_s": p.elapsed_s if p is not None else 0.0,
            "gbps": None if math.isnan(gbps) else gbps,
            "message": p.message if p is not None else "",
            "error": self.error,
            "device_memory": (memory := _device_memory(self.request.devices)),
            # The model manager's view; names as ollama's /api/ps has them where it
            # has them (size, size_vram, expires_at).
            "size": self.request.nbytes,
            "size_vram": sum(memory.values()),
            "leases": self.leases,
            "pinned": self.pinned,
            "keep_alive": keep_alive_json(self.keep_alive_s),
            "expires_at": None if (end := self.deadline()) is None else wall_clock_iso(end),
            "last_used": wall_clock_iso(self.last_used),
            "reload_s": self.reload_s,
            "source": self.kind.value,
            "unload_reason": self.unload_reason,
        }
        if self.report is not None:
            data["report"] = _report_summary(self.report)
        return data

    # Progress arrives on the loop thread, from the load's own task.
    def on_progress(self, progress: Progress) -> None:
        """Keep the load's latest progress and publish it to the subscribers."""
        self.progress = progress
        # The engine's final event (done / failed / cancelled) is followed at once by the state
        # change, which publishes the snapshot that ends the stream.
        if not progress.final:
            self.publish()

    def publish(self) -> None:
        """Send the current snapshot to every subscriber."""
        # A slow client misses intermediate snapshots, never the end.
        self._fan.publish(self.snapshot(), final=self.settled)
        self._notify()

    def subscribe(self, buffer: int = 32) -> MemoryObjectReceiveStream[dict[str, Any]]:
        """Snapshots from now on, starting with the current one; ends once settled."""
        if self.settled:
            self._fan.close()
        return self._fan.subscribe(buffer, self.snapshot())

    def close_subscribers(self) -> None:
        """End every subscriber's stream."""
        self._fan.close()
        self._notify()

    def _notify(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()


def _device_memory(devices: Sequence[Device]) -> dict[str, int]:
    """Bytes of device memory held right now per device that counts them (simulated
    GPUs): loads and models, not what the device's arena keeps idle for the next load."""
    idle = {id(arena.target): arena.stats().idle_bytes for arena in device_arenas()}
    memory: dict[str, int] = {}
    for device in devices:
        live = getattr(device, "live", None)
        nbytes = getattr(live, "buffer_bytes", None)
        if isinstance(nbytes, int):
            memory[device.name] = nbytes - idle.get(id(device), 0)
    return memory


def _report_summary(report: LoadReport) -> dict[str, Any]:
    return {
        "mode": report.mode,
        "total_s": report.total_s,
        "nbytes": report.nbytes,
        "n_tensors": report.n_tensors,
        "gbps": report.gbps,
        "validated": report.validated,
        "warnings": list(report.warnings),
        "buffers": [
            {
                "device": b.device,
                "buffer_type": b.buffer_type,
                "lazy": b.lazy,
                "nbytes": b.nbytes,
                "n_tensors": b.n_tensors,
            }
            for b in report.buffers
        ],
    }


def load_key(request: LoadRequest) -> tuple[object, ...]:
    """What makes two loads one resident model: the path, the very files it named, the
    config, the devices."""
    return (
        request.path,
        request.file_ids,
        request.config.model_dump_json(),
        tuple(device.name for device in request.devices),
    )
