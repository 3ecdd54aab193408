"""Which devices a load can use, from its configuration: the CPU, then real GPUs (CuPy)
or the simulated ones its ``[[device]]`` entries describe.

Both kinds are found once per process and then reused: real GPUs because finding them
imports CuPy and starts CUDA (slow, and partly under the GIL), simulated ones because a
device is also where its staging pool lives, so that the second load of a model finds
the slots the first one pinned.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from aiogguf._config import Config, SimDeviceConfig
from aiogguf.errors import ConfigError
from aiogguf.io._devices.base import Device, all_buffer_types
from aiogguf.io._devices.cpu import CpuDevice

if TYPE_CHECKING:
    from aiogguf.io._devices.sim import SimDevice

__all__ = ["enumerate_devices", "sim_device", "sim_devices"]

# Distinct ``[[device]]`` lists remembered; beyond that the oldest devices are forgotten
# (their pools stay until ``release_device_memory``).
_SIM_CACHE_SIZE = 32
_sim_cache: OrderedDict[tuple[SimDeviceConfig, ...], tuple[SimDevice, ...]] = OrderedDict()
_sim_lock = threading.Lock()


def sim_device(config: SimDeviceConfig, index: int) -> SimDevice:
    """A new device for one ``[[device]]`` entry, ``index`` naming it ``g<index>``. The
    entry's fields are the device's settings, by the same names (``id`` is its
    ``device_id``)."""
    # The backends are imported by the thread that first finds such a device (a load's,
    # ``warm_up``'s), not with the loader: a CPU load needs neither.
    from aiogguf.io._devices.sim import SimDevice

    settings = config.model_dump(exclude={"name", "id"})
    name = config.name if config.name is not None else f"g{index}"
    return SimDevice(name, device_id=config.id, **settings)


def sim_devices(configs: Sequence[SimDeviceConfig]) -> tuple[SimDevice, ...]:
    """The devices of ``[[device]]`` entries, in order, named ``g0``, ``g1``, ... unless
    they carry a name; the same objects for the same entries, process-wide."""
    key = tuple(configs)
    with _sim_lock:
        found = _sim_cache.get(key)
        if found is None:
            found = tuple(sim_device(c, i) for i, c in enumerate(key))
            _sim_cache[key] = found
            while len(_sim_cache) > _SIM_CACHE_SIZE:
                _sim_cache.popitem(last=False)
        else:
            _sim_cache.move_to_end(key)
        return found


def enumerate_devices(
    config: Config | None = None, *, cupy: bool | None = None
) -> tuple[Device, ...]:
    """The devices of this process for ``config``: ``CPU`` first, then CuPy GPUs, then the
    simulated devices of ``config.device``, in order. Blocking the first time (CuPy's
    import and CUDA's start-up): call it from a worker thread.

    ``cupy``: include real GPUs; by default only when ``config`` declares no simulated
    devices (a dry run with ``--sim-gpu`` plans for those GPUs, not the machine's).
    This is the raw list: de-duplication by ``device_id``, the iGPU rule and
    ``split_mode = "none"`` are the plan's business.

    Raises ``ConfigError`` when two devices would share a buffer type name.
    """
    config = config if config is not None else Config()
    if cupy is None:
        cupy = not config.device
    devices: list[Device] = [CpuDevice()]
    if cupy:
        from aiogguf.io._devices.cupy_backend import cupy_devices

        devices.extend(cupy_devices())
    devices.extend(sim_devices(config.device))
    owners: dict[str, Device] = {}
    for device in devices:
        for buffer_type in all_buffer_types(device):
            owner = owners.setdefault(buffer_type.name, device)
            # CUDA devices share one pinned host type; every other name has one owner.
            if owner is not device and buffer_type.name != "CUDA_Host":
                raise ConfigError(
                    "device.name",
                    config.source,
                    f"buffer type {buffer_type.name!r} of device {device.name!r} "
                    f"clashes with device {owner.name!r}; give the devices distinct names",
                )
    return tuple(devices)
