"""The loader on each node: a Ray actor (one per node, placed by node affinity) that
says what its node has, makes the plan where the model is readable, loads its node's
part of the plan from its node's own storage, and then holds that part resident
until the driver closes it.

Everything here runs in the node's actor process, on the actor's event loop (a Ray
async actor): the load is aiogguf's own, over the node's own devices (its CUDA GPUs, or
the simulated GPUs of ``AIOGGUF_SIM_GPUS`` in its raylet's environment), following
the node's part of the driver's plan (``aiogguf._core``'s ``planner`` seam), so that no
byte of another node's part is allocated or read here, and none of its own passes the
driver. The class is plain Python: the driver makes it an actor (``ray.remote``).
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from aiogguf._addresses import is_remote
from aiogguf._api import LoadHandle, release_device_memory
from aiogguf._config import Config
from aiogguf._devices import enumerate_devices
from aiogguf._dry_run import inspect
from aiogguf._dry_run import plan as dry_plan
from aiogguf._events import Progress
from aiogguf._model import Model
from aiogguf._records import GGUFArray, Plan, WeightIndex
from aiogguf.cluster._attach import NodeAttach
from aiogguf.cluster._nodes import NodeDevice, NodeInfo, describe_device
from aiogguf.errors import GGUFError, LoadError, TensorFailure, TensorValidationError
from aiogguf.io._devices.base import Device
from aiogguf.io._devices.cpu import CpuDevice

__all__ = [
    "SIM_GPUS_ENV",
    "NodeLoader",
    "NodeOutcome",
    "fingerprint",
    "node_config",
    "plain_metadata",
]

# ``;``-separated ``--sim-gpu`` specs: the simulated GPUs of a node (its raylet's env).
SIM_GPUS_ENV = "AIOGGUF_SIM_GPUS"


@dataclass(frozen=True, slots=True)
class NodeOutcome:
    """How a node's part of a load ended: the tensor bytes it loaded, the file bytes its
    reads took (the report's, per file; ``rchar``: what the process read, ``/proc``),
    seconds, its bad tensors, or another error (its type's name and message);
    ``cancelled`` when the driver cancelled it; where engines on the node attach to
    its part (``socket``, ``model_id``)."""

    node: str
    nbytes: int = 0
    read_bytes: int = 0
    rchar: int = 0
    seconds: float = 0.0
    failures: tuple[TensorFailure, ...] = ()
    error: str | None = None
    error_type: str = ""
    cancelled: bool = False
    socket: str = ""
    model_id: str = ""


def fingerprint(index: WeightIndex) -> str:
    """What makes two copies of a model the same to a plan: each tensor's name, type,
    offset and size, hashed. A node whose replica differs must not follow the plan."""
    digest = hashlib.sha256()
    for t in index.tensors:
        digest.update(f"{t.name}\0{t.type.id}\0{t.file_index}\0{t.offset}\0{t.nbytes}\n".encode())
    return digest.hexdigest()


def plain_metadata(index: WeightIndex) -> dict[str, Any]:
    """The model's metadata as plain Python values (arrays as lists), to send away."""
    return {
        key: entry.value.to_python() if isinstance(entry.value, GGUFArray) else entry.value
        for key, entry in index.metadata.items()
    }


def node_config(config: Config) -> Config:
    """``config`` on this node: its simulated GPUs are its own (``AIOGGUF_SIM_GPUS``)."""
    specs = [s.strip() for s in os.environ.get(SIM_GPUS_ENV, "").split(";") if s.strip()]
    return config.with_overrides(sim_gpus=specs) if specs else config


def _rchar() -> int:
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _unreadable(path: str) -> str | None:
    """Blocking: why this node cannot read ``path`` (None: it can). Opens it and reads
    nothing; a URL or hub name is fetched by the node itself, later."""
    if is_remote(path):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        return exc.strerror or str(exc)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "not a regular file"
    finally:
        os.close(fd)
    return None


class NodeLoader:
    """One node's loader (made a Ray actor by the driver). Its methods are called by the
    driver in this order: ``describe``, ``plan`` (one node), ``load``; ``progress`` and
    ``cancel`` while it loads; ``fetch``, ``held`` and ``leases`` after; ``close`` last.
    Once loaded, its part is served for attach on a socket of this node (``NodeAttach``)
    until ``close``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._model: Model | None = None
        self._devices: tuple[Device, ...] = ()
        self._progress = (0, 0)
        self._scope: anyio.CancelScope | None = None
        self._done: anyio.Event | None = None
        self._ended = 0.0
        self._attach: NodeAttach | None = None

    async def describe(self, path: str, config: Config) -> NodeInfo:
        """This node's devices (named by node), host memory, and whether it can read
        ``path``."""
        local = node_config(config)
        self._devices = await anyio.to_thread.run_sync(enumerate_devices, local)
        described = [describe_device(d, self.name) for d in self._devices]
        free, total = next(d for d in self._devices if isinstance(d, CpuDevice)).memory()
        unreadable = await anyio.to_thread.run_sync(_unreadable, path)
        import ray  # pyright: ignore[reportMissingImports]  (the actor runs under Ray: its own node id)

        node_id = ray.get_runtime_context().get_node_id()
        return NodeInfo(self.name, node_id, tuple(described), free, total, path, unreadable)

    async def plan(
        self, path: str, devices: Sequence[NodeDevice], config: Config
    ) -> tuple[Plan, dict[str, Any], str]:
        """The plan over the cluster's ``devices``, from this node's copy of the model's
        headers (no tensor byte is read), the model's metadata as plain values, and its
        index's fingerprint."""
        index = await inspect(path)
        # As a load of ``path`` plans: a remote source is read in mode none, say.
        plan = await dry_plan(path, config, devices=devices)
        return plan, plain_metadata(index), fingerprint(index)

    def progress(self) -> tuple[int, int]:
        """``(bytes_done, bytes_total)`` of this node's part so far."""
        return self._progress

    def _on_progress(self, event: Progress) -> None:
        self._progress = (event.bytes_done, event.bytes_total)

    async def load(
        self,
        path: str,
        part: Plan,
        expected: str,
        config: Config,
        socket_dir: str | None = None,
        attach: bool = True,
    ) -> NodeOutcome:
        """Load this node's ``part`` of the plan from ``path`` (this node's copy, which
        must be the model of fingerprint ``expected``), keep it, and serve it for
        attach on a socket in a private folder made under ``socket_dir`` (None: the
        node's runtime folder), unless ``attach`` is false. Never raises for the load's
        own failures: they come back in the outcome."""
        self._scope = anyio.CancelScope()
        self._done = anyio.Event()
        local = node_config(config)
        if attach:  # engines on this node map the part instead of loading it again
            local = local.with_settings({"shareable": True})
        name = self.name

        def planner(index: WeightIndex, devices: Sequence[Device], config: Config) -> Plan:
            if fingerprint(index) != expected:
                raise LoadError(
                    path, None, f"on node {name} is not the model the plan was made for"
                )
            return part

        handle = LoadHandle(
            path,
            local,
            progress=self._on_progress,
            devices=self._devices or None,
            planner=planner,
        )
        began, rchar = time.perf_counter(), _rchar()
        try:
            with self._scope:
                self._model = await handle.__aenter__()
        except TensorValidationError as exc:
            return NodeOutcome(self.name, failures=exc.failures)
        except GGUFError as exc:
            return NodeOutcome(self.name, error=str(exc), error_type=type(exc).__name__)
        finally:
            self._ended = time.perf_counter()
            self._done.set()
        if self._model is None:
            return NodeOutcome(self.name, cancelled=True)
        if attach:
            self._attach = NodeAttach(self._model, self.name, socket_dir)
            try:
                await self._attach.start()
            except GGUFError as exc:
                await self.close()
                return NodeOutcome(self.name, error=str(exc), error_type=type(exc).__name__)
        report = self._model.report
        return NodeOutcome(
            self.name,
            nbytes=report.nbytes,
            read_bytes=sum(f.nbytes for f in report.files),
            rchar=_rchar() - rchar,
            seconds=self._ended - began,
            socket=self._attach.path if self._attach is not None else "",
            model_id=self._attach.id if self._attach is not None else "",
        )

    async def cancel(self) -> float:
        """End this node's part (a load still running is cancelled), free what it
        holds, and return the seconds the load took to end once asked (0 when none
        ran)."""
        asked = time.perf_counter()
        if self._scope is not None and self._done is not None:
            self._scope.cancel()
            await self._done.wait()
        ended = max(self._ended, asked) - asked if self._done is not None else 0.0
        await self.close()
        return ended

    def fetch(self, name: str) -> bytes:
        """A copy of tensor ``name``'s bytes (one of this node's part)."""
        if self._model is None:
            raise LoadError(None, None, f"node {self.name} holds no model")
        return bytes(self._model.raw(name))

    def held(self) -> int:
        """The bytes this loader holds: the model's tensors, and device memory still
        allocated on a simulated GPU."""
        held = self._model.report.nbytes if self._model is not None else 0
        for device in self._devices:
            live = getattr(device, "live", None)
            if live is not None:
                held += int(live.buffer_bytes)
        return held

    def leases(self) -> int:
        """How many processes are attached to this node's part now."""
        return self._attach.leases if self._attach is not None else 0

    async def close(self) -> None:
        """Stop serving the part for attach (each attached client is told), free the
        model and the memory loads keep for the next one. Idempotent."""
        attach, self._attach = self._attach, None
        if attach is not None:
            await attach.close()
        model, self._model = self._model, None
        if model is not None:
            await model.aclose()
        await release_device_memory()
