"""Simulated GPUs (``[[device]]`` / ``--sim-gpu``) for dry runs and tests.

This module describes a simulated device: its memory, capabilities and buffer types,
every one of them settable, including ggml types it refuses to hold. The copy engine
(a thread with events that checks staging-slot reuse) is a separate object built on a
``SimDevice``; the ``bandwidth`` and ``max_delay_ms`` fields are kept here for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from aiogguf.config import SimDeviceConfig
from aiogguf.errors import ConfigError
from aiogguf.io.devices.base import BufferRole, BufferType, DeviceCaps, DeviceKind
from aiogguf.io.ggml_types import GGMLType, ggml_type_by_name

__all__ = ["SimDevice", "sim_devices"]


class SimDevice:
    """A simulated GPU named ``name`` (default ``g<index>``); buffer types ``name``,
    ``name_Host`` (pinned host) and ``name_Split`` (row split)."""

    backend = "sim"

    def __init__(
        self,
        name: str,
        *,
        kind: DeviceKind = "gpu",
        free: int = 24 * 1024**3,
        total: int | None = None,
        device_id: str | None = None,
        unsupported: Iterable[str] = (),
        host_pointer: bool = False,
        async_copies: bool = True,
        events: bool = True,
        pinned_host: bool = True,
        split_buffer: bool = True,
        mmap: bool = True,
        extra_buffer_types: Sequence[str] = (),
        bandwidth: int | None = None,
        max_delay_ms: float = 0.0,
    ) -> None:
        if kind == "cpu":
            raise ConfigError("device.kind", None, "a simulated device cannot be the CPU")
        self.name = name
        self.kind: DeviceKind = kind
        self.device_id = device_id
        self.free = free
        self.total = total if total is not None else free
        self.caps = DeviceCaps(
            host_pointer=host_pointer, async_copies=async_copies, events=events, mmap=mmap
        )
        unsupported_types: set[int] = set()
        for type_name in unsupported:
            try:
                unsupported_types.add(ggml_type_by_name(type_name).id)
            except KeyError:
                raise ConfigError(
                    "device.unsupported", None, f"{type_name!r} is not a ggml type name"
                ) from None
        self.unsupported = frozenset(unsupported_types)
        # An accelerator computes in host memory (llama.cpp's BLAS/AMX devices).
        self.buffer_type = BufferType(name, name, BufferRole.DEFAULT, host=kind == "accel")
        self.host_buffer_type = (
            BufferType(f"{name}_Host", name, BufferRole.HOST, host=True) if pinned_host else None
        )
        self.split_buffer_type = (
            BufferType(f"{name}_Split", name, BufferRole.SPLIT, host=False, matrices_only=True)
            if split_buffer
            else None
        )
        self.extra_buffer_types = tuple(
            BufferType(f"{name}_{suffix}", name, BufferRole.EXTRA, host=kind == "accel")
            for suffix in extra_buffer_types
        )
        self.bandwidth = bandwidth
        self.max_delay_ms = max_delay_ms

    @classmethod
    def from_config(cls, config: SimDeviceConfig, index: int) -> SimDevice:
        """The device described by one ``[[device]]`` entry, ``index`` naming it ``g<index>``."""
        return cls(
            config.name if config.name is not None else f"g{index}",
            kind=config.kind,
            free=config.free,
            total=config.total,
            device_id=config.id,
            unsupported=config.unsupported,
            host_pointer=config.host_pointer,
            async_copies=config.async_copies,
            events=config.events,
            pinned_host=config.pinned_host,
            split_buffer=config.split_buffer,
            mmap=config.mmap,
            bandwidth=config.bandwidth,
            max_delay_ms=config.max_delay_ms,
        )

    def memory(self) -> tuple[int, int]:
        return self.free, self.total

    def supports(self, tensor_type: GGMLType) -> bool:
        return tensor_type.valid and tensor_type.id not in self.unsupported

    def __repr__(self) -> str:
        return f"SimDevice({self.name!r}, kind={self.kind!r}, free={self.free})"


def sim_devices(configs: Sequence[SimDeviceConfig]) -> tuple[SimDevice, ...]:
    """One ``SimDevice`` per ``[[device]]`` entry, in order, named ``g0``, ``g1``, ... unless
    they carry a name."""
    return tuple(SimDevice.from_config(c, i) for i, c in enumerate(configs))
