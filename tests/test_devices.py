"""Device backends: the protocol, buffer type names, sim settings, CuPy's absence."""

from __future__ import annotations

import os
import sys
import types
import warnings
from typing import Any

import pytest

from aiogguf._config import Config, SimDeviceConfig
from aiogguf._devices import enumerate_devices, sim_device
from aiogguf.errors import ConfigError
from aiogguf.io._devices import (
    BufferRole,
    CpuDevice,
    Device,
    SimDevice,
    all_buffer_types,
    cupy_backend,
)
from aiogguf.io._devices.cpu import host_memory
from aiogguf.io.ggml_types import ggml_type_by_name

GiB = 1024**3


def test_host_memory_matches_sysconf() -> None:
    free, total = host_memory()
    page = os.sysconf("SC_PAGE_SIZE")
    sys_total = os.sysconf("SC_PHYS_PAGES") * page
    assert 0 < free <= total
    # /proc/meminfo's MemTotal and sysconf agree to within a page per MiB.
    assert abs(total - sys_total) <= sys_total // 256


def test_cpu_device() -> None:
    cpu = CpuDevice()
    assert isinstance(cpu, Device)
    assert (cpu.name, cpu.kind, cpu.backend, cpu.device_id) == ("CPU", "cpu", "cpu", None)
    assert cpu.buffer_type.name == "CPU"
    assert cpu.buffer_type.host
    assert cpu.host_buffer_type is None
    assert cpu.split_buffer_type is None
    assert cpu.caps.host_pointer
    assert cpu.caps.mmap
    assert cpu.supports(ggml_type_by_name("IQ1_M"))
    assert not cpu.supports(ggml_type_by_name("Q4_2"))  # removed type id
    assert CpuDevice(free=3, total=5).memory() == (3, 5)
    extra = CpuDevice(extra_buffer_types=("REPACK",))
    assert [b.name for b in extra.extra_buffer_types] == ["CPU_REPACK"]


def test_sim_device_names_and_capabilities() -> None:
    cfg = SimDeviceConfig.from_spec("free=12GiB,total=16GiB,unsupported=IQ1_M+TQ1_0")
    dev = sim_device(cfg, 3)
    assert isinstance(dev, Device)
    assert dev.name == "g3"
    assert dev.kind == "gpu"
    assert dev.backend == "sim"
    assert dev.memory() == (12 * GiB, 16 * GiB)
    assert [b.name for b in all_buffer_types(dev)] == ["g3", "g3_Split", "g3_Host"]
    assert dev.buffer_type.role is BufferRole.DEFAULT
    assert not dev.buffer_type.host
    assert dev.host_buffer_type is not None
    assert dev.host_buffer_type.host
    assert dev.split_buffer_type is not None
    assert dev.split_buffer_type.matrices_only
    assert not dev.supports(ggml_type_by_name("IQ1_M"))
    assert not dev.supports(ggml_type_by_name("TQ1_0"))
    assert dev.supports(ggml_type_by_name("Q4_K"))


def test_sim_device_every_setting() -> None:
    dev = SimDevice(
        "acc",
        kind="accel",
        free=1,
        total=2,
        device_id="0000:01:00.0",
        host_pointer=True,
        async_copies=False,
        events=False,
        pinned_host=False,
        split_buffer=False,
        mmap=False,
        extra_buffer_types=("AMX",),
    )
    assert dev.host_buffer_type is None
    assert dev.split_buffer_type is None
    assert dev.buffer_type.host  # an accelerator computes in host memory
    assert [b.name for b in dev.extra_buffer_types] == ["acc_AMX"]
    caps = dev.caps
    assert (caps.host_pointer, caps.async_copies, caps.events, caps.mmap) == (
        True,
        False,
        False,
        False,
    )
    assert dev.memory() == (1, 2)
    assert dev.device_id == "0000:01:00.0"


def test_sim_device_rejects_unknown_type_name() -> None:
    with pytest.raises(ConfigError, match="'IQ9_Z' is not a ggml type"):
        SimDevice("g0", unsupported=("IQ9_Z",))


def test_enumerate_devices_cpu_then_sims() -> None:
    config = Config().with_overrides(sim_gpus=["24GiB", "name=big,free=48GiB"])
    devices = enumerate_devices(config)
    assert [d.name for d in devices] == ["CPU", "g0", "big"]
    assert [b.name for b in all_buffer_types(devices[2])] == ["big", "big_Split", "big_Host"]


def test_enumerate_devices_without_cupy_is_cpu_only() -> None:
    # CuPy is not installed on the test machines: no GPU, no error.
    devices = enumerate_devices(Config(), cupy=True)
    assert devices[0].name == "CPU"
    assert all(d.backend in ("cpu", "cupy") for d in devices)
    if cupy_backend.import_cupy() is None:
        assert len(devices) == 1


def test_enumerate_devices_rejects_clashing_names() -> None:
    config = Config().with_overrides(sim_gpus=["name=x,free=1GiB", "name=x,free=2GiB"])
    with pytest.raises(ConfigError, match="clashes with device 'x'"):
        enumerate_devices(config)
    with pytest.raises(ConfigError, match="clashes"):
        enumerate_devices(Config().with_overrides(sim_gpus=["name=CPU,free=1GiB"]))


def test_import_cupy_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes ``import cupy`` raise ImportError
    assert cupy_backend.import_cupy() is None
    assert cupy_backend.cupy_devices() == ()


class _FakeDevice:
    def __init__(self, ordinal: int) -> None:
        self.ordinal = ordinal

    def __enter__(self) -> _FakeDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _fake_cupy(bus_ids: list[str], integrated: list[int]) -> Any:
    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: len(bus_ids),
        getDeviceProperties=lambda i: {"integrated": integrated[i]},
        deviceGetPCIBusId=lambda i: bus_ids[i],
        memGetInfo=lambda: (5 * GiB, 8 * GiB),
    )
    return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime, Device=_FakeDevice))


def test_cupy_devices_dedupe_by_pci_bus_id(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_cupy(["0000:01:00.0", "0000:01:00.0", "0000:02:00.0"], [0, 0, 1])
    monkeypatch.setattr(cupy_backend, "import_cupy", lambda: fake)
    devices = cupy_backend.cupy_devices()
    assert [(d.name, d.kind, d.device_id) for d in devices] == [
        ("CUDA0", "gpu", "0000:01:00.0"),
        ("CUDA2", "igpu", "0000:02:00.0"),
    ]
    cuda0 = devices[0]
    assert isinstance(cuda0, Device)
    assert [b.name for b in all_buffer_types(cuda0)] == ["CUDA0", "CUDA0_Split", "CUDA_Host"]
    assert cuda0.memory() == (5 * GiB, 8 * GiB)
    assert cuda0.supports(ggml_type_by_name("IQ1_M"))
    # Real GPUs join only when no simulated device is configured, or when asked.
    assert [d.name for d in enumerate_devices(Config())] == ["CPU", "CUDA0", "CUDA2"]
    sims = Config().with_overrides(sim_gpus=["1GiB"])
    assert [d.name for d in enumerate_devices(sims)] == ["CPU", "g0"]
    assert [d.name for d in enumerate_devices(sims, cupy=True)] == ["CPU", "CUDA0", "CUDA2", "g0"]


def test_cupy_device_without_driver_reports_no_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_driver() -> int:
        raise RuntimeError("cudaErrorNoDevice")

    fake = _fake_cupy([], [])
    fake.cuda.runtime.getDeviceCount = no_driver
    monkeypatch.setattr(cupy_backend, "import_cupy", lambda: fake)
    assert cupy_backend.cupy_devices() == ()


def test_a_broken_cupy_is_said_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """CuPy installed but failing to start (a broken CUDA install) must not quietly
    become a CPU load: one RuntimeWarning says so, then the load goes on without GPUs."""
    real_import = __import__

    def importer(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "cupy":
            raise RuntimeError("CUDA driver version is insufficient")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr("builtins.__import__", importer)
    with pytest.warns(RuntimeWarning, match="CuPy is installed but cannot be imported"):
        assert cupy_backend.import_cupy() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cupy_backend.import_cupy() is None  # said once
