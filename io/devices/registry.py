"""Which devices a load can use: the CPU, then real GPUs (CuPy) or simulated ones."""

from __future__ import annotations

from aiogguf.config import Config
from aiogguf.errors import ConfigError
from aiogguf.io.devices.base import Device, all_buffer_types
from aiogguf.io.devices.cpu import CpuDevice
from aiogguf.io.devices.cupy_backend import cupy_devices
from aiogguf.io.devices.sim import sim_devices

__all__ = ["enumerate_devices"]


def enumerate_devices(
    config: Config | None = None, *, cupy: bool | None = None
) -> tuple[Device, ...]:
    """The devices of this process for ``config``: ``CPU`` first, then CuPy GPUs, then the
    simulated devices of ``config.device``, in order.

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
