"""The driver's side of a load over a Ray cluster: a loader on every node, one plan
over the union of their devices, each node's part loaded by its node from its own
storage, one verdict.

Flow (``ClusterLoad``): connect (``address=``, or the initialised Ray); name the alive
nodes (``node_names``); start one ``NodeLoader`` actor per node, pinned to it by node
affinity; each describes its devices and whether it can read its path; the CPU node's
loader (or the first that can read) makes the plan from its copy's headers; every node
that holds a part and cannot read its copy is named, all at once, before any byte is
read; the other loaders are stopped; each loading node then loads its part while the
driver polls each node's progress, and the model is the nodes' parts, each resident in
its node's loader.

Failure: a node's bad tensors are gathered from every node (one
``TensorValidationError``, each failure naming its node); any other error of a node, a
node that dies (its actor's death, from Ray) or stops answering, or the driver's
cancellation ends the other nodes' parts at once (each loader cancels its load and
frees it) and stops every loader.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt

from aiogguf._config import Config, load_config
from aiogguf._core.engine import one_error
from aiogguf._run import run
from aiogguf.cluster._actor import NodeLoader, NodeOutcome
from aiogguf.cluster._nodes import NodeInfo, node_names, node_of, order_nodes
from aiogguf.cluster._placement import ClusterPlan, cluster_config, union_devices
from aiogguf.errors import (
    ClosedResourceError,
    ConfigError,
    GGUFError,
    LoadError,
    TensorFailure,
    TensorValidationError,
)

__all__ = [
    "AttachAddress",
    "ClusterLoad",
    "ClusterModel",
    "ClusterProgress",
    "ClusterReport",
    "NodeRow",
    "load",
    "load_sync",
    "plan",
    "plan_sync",
]

# Seconds a node may take to answer a progress poll before the load names it dead (Ray
# says so sooner when it sees the node go: its health checks).
NODE_TIMEOUT_S = 8.0
# Seconds a loader may take to cancel and free its part, or to close, when told to.
_STOP_S = 10.0


@dataclass(frozen=True, slots=True)
class NodeRow:
    """One node's part of a load: tensor bytes loaded, file bytes its reads took,
    seconds, and what the kernel counted its loader's process reading meanwhile
    (``rchar``: the file's bytes, its header, anything else it read)."""

    node: str
    nbytes: int
    read_bytes: int
    seconds: float
    process_read_bytes: int = 0

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class AttachAddress:
    """Where an engine on node ``node`` attaches to that node's part:
    ``aiogguf.attach(model_id, socket=socket)``, in a process on that node."""

    node: str
    socket: str
    model_id: str


@dataclass(frozen=True, slots=True)
class ClusterReport:
    """A load over the cluster: a row per loading node; the whole load's seconds as the
    driver saw them (``total_s``: from its start, the loaders' start-up and the plan
    included, to the last node's end) and those of its loading half (``load_s``: from
    the parts' start to the last one's end)."""

    path: str
    rows: tuple[NodeRow, ...]
    total_s: float
    load_s: float

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows)

    @property
    def read_bytes(self) -> int:
        return sum(r.read_bytes for r in self.rows)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.total_s / 1e9 if self.total_s > 0 else 0.0

    def row(self, node: str) -> NodeRow:
        """Node ``node``'s row; ``KeyError`` when it loaded nothing."""
        for r in self.rows:
            if r.node == node:
                return r
        raise KeyError(node)


@dataclass(frozen=True, slots=True)
class ClusterProgress:
    """Where a load over the cluster stands: ``(node, bytes_done, bytes_total)`` per
    loading node, and the seconds since it began."""

    nodes: tuple[tuple[str, int, int], ...]
    elapsed_s: float

    @property
    def bytes_done(self) -> int:
        return sum(n[1] for n in self.nodes)

    @property
    def bytes_total(self) -> int:
        return sum(n[2] for n in self.nodes)

    @property
    def fraction(self) -> float:
        total = self.bytes_total
        return self.bytes_done / total if total else 0.0


ClusterProgressCallback = Callable[[ClusterProgress], None]


def _ray() -> Any:
    """Ray, or a ``ConfigError`` saying which extra brings it."""
    try:
        import ray  # pyright: ignore[reportMissingImports]  (optional: the cluster extra)
    except ImportError as exc:
        raise ConfigError(
            "cluster", None, "aiogguf.cluster needs Ray: pip install 'aiogguf[cluster]'"
        ) from exc
    return ray


def _connect(address: str | None) -> Any:
    """Blocking: Ray, initialised (``address``: the cluster to join when it is not)."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    return ray


def _alive_nodes(ray: Any) -> tuple[dict[str, str], str | None]:
    """Blocking: each alive node's name by node id, and the driver's node id."""
    alive = [(n["NodeID"], dict(n.get("Labels") or {})) for n in ray.nodes() if n["Alive"]]
    try:
        mine: str | None = ray.get_runtime_context().get_node_id()
    except Exception:  # a client outside the cluster has no node
        mine = None
    return node_names(alive), mine


class _Loaders:
    """One ``NodeLoader`` actor per node, each pinned to its node; stops them all."""

    def __init__(self, ray: Any, names: Mapping[str, str]) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # pyright: ignore[reportMissingImports]  (optional: the cluster extra)

        self.ray = ray
        actor_class = ray.remote(NodeLoader)
        self.actors: dict[str, Any] = {}
        for node_id, name in names.items():
            self.actors[name] = actor_class.options(
                num_cpus=0,
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(name)

    async def stop(self, names: list[str] | None = None) -> None:
        """Stop the loaders of ``names`` (None: all): their processes end, and with them
        whatever they held."""
        chosen = list(self.actors) if names is None else names
        actors = [self.actors.pop(n) for n in chosen if n in self.actors]
        ray = self.ray

        def kill() -> None:
            for actor in actors:
                with suppress(Exception):  # already gone with its node
                    ray.kill(actor, no_restart=True)

        if actors:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(kill)


def _node_error(exc: BaseException, node: str, path: str) -> LoadError:
    """A node's failure as the driver says it: one ``LoadError`` naming the node."""
    ray = _ray()
    if isinstance(exc, ray.exceptions.RayActorError):
        return LoadError(path, None, f"node {node} died during the load (its loader is gone)")
    # A loader's own exception, without the traceback Ray wraps it in.
    cause = getattr(exc, "cause", None) or exc
    return LoadError(path, None, f"node {node}: {type(cause).__name__}: {cause}")


async def _ask(ref: Any, node: str, path: str, timeout_s: float | None = None) -> Any:
    """The result of one call to node ``node``'s loader, a node's death as a
    ``LoadError`` naming it."""
    ray = _ray()
    try:
        if timeout_s is None:
            return await ref
        with anyio.fail_after(timeout_s):
            return await ref
    except TimeoutError as exc:
        raise LoadError(
            path, None, f"node {node} did not answer for {timeout_s:.0f} s (is it down?)"
        ) from exc
    except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
        raise _node_error(exc, node, path) from exc


async def _make_plan(
    loaders: _Loaders,
    path: str,
    paths: Mapping[str, str],
    config: Config,
    cpu_node: str,
) -> tuple[ClusterPlan, dict[str, Any], str]:
    """Every node described; the plan, the model's metadata and its index's
    fingerprint, made by the CPU node's loader (or the first that can read the model)."""
    infos: dict[str, NodeInfo] = {}

    async def describe(node: str) -> None:
        ref = loaders.actors[node].describe.remote(paths.get(node, path), config)
        infos[node] = await _ask(ref, node, path, NODE_TIMEOUT_S * 4)

    with one_error():
        async with anyio.create_task_group() as tg:
            for node in loaders.actors:
                tg.start_soon(describe, node)
    nodes = tuple(infos[n] for n in order_nodes(infos))
    devices = union_devices(nodes, cpu_node)
    readers = [n.name for n in nodes if n.unreadable is None]
    if not readers:
        raise _unreadable_error(path, nodes)
    planner = cpu_node if cpu_node in readers else readers[0]
    ref = loaders.actors[planner].plan.remote(
        paths.get(planner, path), devices, cluster_config(config, cpu_node)
    )
    plan, metadata, fp = await _ask(ref, planner, path)
    return ClusterPlan(plan, nodes, cpu_node), metadata, fp


def _unreadable_error(path: str, nodes: tuple[NodeInfo, ...]) -> LoadError:
    said = "; ".join(f"node {n.name} cannot read {n.path}: {n.unreadable}" for n in nodes)
    return LoadError(path, None, said)


def _check_paths(paths: Mapping[str, str], names: Mapping[str, str]) -> None:
    unknown = sorted(set(paths) - set(names.values()))
    if unknown:
        known = ", ".join(order_nodes(names.values()))
        raise ConfigError("paths", None, f"no node named {', '.join(unknown)} (the nodes: {known})")


class ClusterModel:
    """A model loaded over the cluster: each node's part stays resident in that node's
    loader. The driver holds the plan (``plan``), the index and metadata, the report,
    and the loaders: ``fetch(name)`` copies one tensor to the driver; ``aclose()`` (or
    leaving ``async with``) frees every node."""

    def __init__(
        self,
        plan: ClusterPlan,
        metadata: Mapping[str, Any],
        report: ClusterReport,
        loaders: _Loaders,
        addresses: Mapping[str, AttachAddress],
    ) -> None:
        self.plan = plan
        self._metadata = dict(metadata)
        self.report = report
        self._loaders = loaders
        self._addresses = dict(addresses)
        self._node_of = {t.name: node_of(t.device) for t in plan.plan.tensors}
        self._closed = False

    @property
    def metadata(self) -> Mapping[str, Any]:
        """The model's metadata (its first file's), as plain Python values."""
        return self._metadata

    @property
    def nodes(self) -> tuple[str, ...]:
        """The nodes that hold a part of the model."""
        return tuple(order_nodes(self._loaders.actors))

    def node_of(self, name: str) -> str:
        """The node that holds tensor ``name``; ``KeyError`` for a tensor the model lacks."""
        return self._node_of[name]

    def attach_address(self, node: str) -> AttachAddress:
        """Where engines on ``node`` attach to its part (a ``Model`` of that node's
        tensors alone); ``KeyError`` for a node that holds none, or a load with
        ``attach=False``."""
        return self._addresses[node]

    async def leases(self) -> dict[str, int]:
        """How many processes are attached to each node's part now, by node."""
        if self._closed:
            raise ClosedResourceError("the cluster model is closed")
        path = self.report.path
        counts: dict[str, int] = {}

        async def ask(node: str, actor: Any) -> None:
            counts[node] = await _ask(actor.leases.remote(), node, path, NODE_TIMEOUT_S)

        async with anyio.create_task_group() as tg:
            for node, actor in self._loaders.actors.items():
                tg.start_soon(ask, node, actor)
        return {n: counts[n] for n in order_nodes(counts)}

    def leases_sync(self) -> dict[str, int]:
        """``leases`` for code without a loop (blocking)."""
        if self._closed:
            raise ClosedResourceError("the cluster model is closed")
        nodes = list(self._loaders.actors)
        refs = [self._loaders.actors[n].leases.remote() for n in nodes]
        try:
            counts = self._loaders.ray.get(refs, timeout=NODE_TIMEOUT_S)
        except Exception as exc:
            raise LoadError(self.report.path, None, f"a node did not answer: {exc}") from exc
        return {n: int(c) for n, c in zip(nodes, counts, strict=True)}

    def _ref(self, name: str) -> tuple[str, Any]:
        if self._closed:
            raise ClosedResourceError("the cluster model is closed")
        node = self._node_of[name]
        return node, self._loaders.actors[node].fetch.remote(name)

    async def fetch(self, name: str) -> npt.NDArray[np.uint8]:
        """A copy of tensor ``name``'s bytes on the driver (its file's bytes, as a flat
        ``uint8`` array). Raises ``KeyError`` for an unknown tensor, ``LoadError`` when
        its node is gone."""
        node, ref = self._ref(name)
        data: bytes = await _ask(ref, node, self.report.path)
        return np.frombuffer(data, dtype=np.uint8)

    def fetch_sync(self, name: str) -> npt.NDArray[np.uint8]:
        """``fetch`` for code without a loop (blocking)."""
        node, ref = self._ref(name)
        try:
            data: bytes = self._loaders.ray.get(ref)
        except Exception as exc:
            raise _node_error(exc, node, self.report.path) from exc
        return np.frombuffer(data, dtype=np.uint8)

    async def aclose(self) -> None:
        """Free every node's part and stop the loaders. Idempotent. Processes still
        attached are told, in one line, that the driver closed the model; what they
        mapped stays valid in their own processes until they close it."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for node, actor in self._loaders.actors.items():
                    tg.start_soon(_close_one, actor, node, self.report.path)
            await self._loaders.stop()

    def close(self) -> None:
        """``aclose`` for code without a loop (blocking)."""
        if self._closed:
            return
        self._closed = True
        ray = self._loaders.ray
        refs = [a.close.remote() for a in self._loaders.actors.values()]
        ray.wait(refs, num_returns=len(refs), timeout=_STOP_S)
        for actor in self._loaders.actors.values():
            with suppress(Exception):
                ray.kill(actor, no_restart=True)
        self._loaders.actors.clear()

    def __repr__(self) -> str:
        return (
            f"<ClusterModel {self.report.path} {len(self._node_of)} tensors on "
            f"{', '.join(self.nodes)}{' closed' if self._closed else ''}>"
        )


async def _close_one(actor: Any, node: str, path: str) -> None:
    # A node that is gone took what it held with it.
    with anyio.move_on_after(_STOP_S), suppress(LoadError):
        await _ask(actor.close.remote(), node, path)


class ClusterLoad:
    """``async with aiogguf.cluster.load(path, ...) as model``: loads on enter over
    every node of the cluster, frees every node on exit. After a cancelled or failed
    load, ``stopped`` holds, per node whose part was running, the seconds its part took
    to end once told, and ``held_after`` the bytes its loader still held then (0)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        config: Config,
        *,
        address: str | None = None,
        cpu_node: str | None = None,
        paths: Mapping[str, str | os.PathLike[str]] | None = None,
        progress: ClusterProgressCallback | None = None,
        socket_dir: str | os.PathLike[str] | None = None,
        attach: bool = True,
        poll_s: float = 0.1,
        node_timeout_s: float = NODE_TIMEOUT_S,
    ) -> None:
        self.path = os.fspath(path)
        self.config = config
        self.address = address
        self.cpu_node = cpu_node
        self.paths = {k: os.fspath(v) for k, v in (paths or {}).items()}
        self.progress = progress
        self.socket_dir = os.fspath(socket_dir) if socket_dir is not None else None
        self.attach = attach
        self.poll_s = poll_s
        self.node_timeout_s = node_timeout_s
        self.model: ClusterModel | None = None
        self.stopped: dict[str, float] = {}
        self.held_after: dict[str, int] = {}
        self._seen: dict[str, tuple[int, int]] = {}
        self._started = False

    async def __aenter__(self) -> ClusterModel:
        if self._started:
            raise RuntimeError("a ClusterLoad loads once: call aiogguf.cluster.load(...) again")
        self._started = True
        ray = await anyio.to_thread.run_sync(_connect, self.address)
        names, mine = await anyio.to_thread.run_sync(_alive_nodes, ray)
        _check_paths(self.paths, names)
        cpu_node = self.cpu_node or names.get(mine or "", order_nodes(names.values())[0])
        loaders = _Loaders(ray, names)
        try:
            self.model = await self._load(loaders, cpu_node)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._stop_all(loaders)
            raise
        return self.model

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.model is not None:
            await self.model.aclose()

    async def _load(self, loaders: _Loaders, cpu_node: str) -> ClusterModel:
        began = time.perf_counter()
        plan, metadata, fp = await _make_plan(loaders, self.path, self.paths, self.config, cpu_node)
        loading = plan.loading_nodes()
        blind = tuple(plan.node(n) for n in loading if plan.node(n).unreadable is not None)
        if blind:
            raise _unreadable_error(self.path, blind)
        # A node without a part holds nothing: its loader goes now.
        await loaders.stop([n for n in loaders.actors if n not in loading])
        outcomes: dict[str, NodeOutcome] = {}
        self._seen = {n: (0, plan.node_bytes(n)) for n in loading}
        parts_began = time.perf_counter()
        # The first node to fail ends the others' parts; the caller sees its error alone.
        with one_error():
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch, loaders, loading, outcomes, began)
                for node in loading:
                    tg.start_soon(self._load_part, loaders, plan, node, fp, outcomes)
        ended = time.perf_counter()
        failures = [
            TensorFailure(
                f.name, f.type_name, f"on node {o.node}: {f.problem}", f.first_index, f.count
            )
            for node in loading
            for o in (outcomes[node],)
            for f in o.failures
        ]
        if failures:
            raise TensorValidationError(failures, self.path)
        rows = tuple(
            NodeRow(
                n,
                outcomes[n].nbytes,
                outcomes[n].read_bytes,
                outcomes[n].seconds,
                outcomes[n].rchar,
            )
            for n in loading
        )
        addresses = {
            n: AttachAddress(n, outcomes[n].socket, outcomes[n].model_id)
            for n in loading
            if outcomes[n].socket
        }
        return ClusterModel(
            plan,
            metadata,
            ClusterReport(self.path, rows, ended - began, ended - parts_began),
            loaders,
            addresses,
        )

    async def _load_part(
        self,
        loaders: _Loaders,
        plan: ClusterPlan,
        node: str,
        fp: str,
        outcomes: dict[str, NodeOutcome],
    ) -> None:
        path = self.paths.get(node, self.path)
        ref = loaders.actors[node].load.remote(
            path, plan.part(node), fp, self.config, self.socket_dir, self.attach
        )
        outcome: NodeOutcome = await _ask(ref, node, self.path)
        if outcome.error is not None:
            raise LoadError(path, None, f"on node {node}: {outcome.error_type}: {outcome.error}")
        outcomes[node] = outcome

    async def _watch(
        self,
        loaders: _Loaders,
        loading: list[str],
        outcomes: dict[str, NodeOutcome],
        began: float,
    ) -> None:
        """Poll each loading node's progress until every node is done; a node that
        does not answer within ``node_timeout_s`` ends the load, named."""
        while len(outcomes) < len(loading):
            await anyio.sleep(self.poll_s)
            async with anyio.create_task_group() as tg:
                for node in loading:
                    if node not in outcomes:
                        tg.start_soon(self._poll, loaders, node)
            for node, outcome in outcomes.items():
                self._seen[node] = (outcome.nbytes, self._seen[node][1])
            if self.progress is not None:
                self.progress(
                    ClusterProgress(
                        tuple((n, *self._seen[n]) for n in loading),
                        time.perf_counter() - began,
                    )
                )

    async def _poll(self, loaders: _Loaders, node: str) -> None:
        actor = loaders.actors.get(node)
        if actor is None:
            return
        done, total = await _ask(actor.progress.remote(), node, self.path, self.node_timeout_s)
        if total:
            self._seen[node] = (done, total)

    async def _stop_all(self, loaders: _Loaders) -> None:
        """Every loader told to end and free its part (each within ``_STOP_S``), then
        stopped. Shielded by the caller."""

        async def stop(node: str, actor: Any) -> None:
            with anyio.move_on_after(_STOP_S):
                try:
                    self.stopped[node] = await _ask(actor.cancel.remote(), node, self.path)
                    self.held_after[node] = await _ask(actor.held.remote(), node, self.path)
                except (LoadError, GGUFError):
                    pass  # that node is gone, and what it held with it

        async with anyio.create_task_group() as tg:
            for node, actor in loaders.actors.items():
                tg.start_soon(stop, node, actor)
        await loaders.stop()


def load(
    path: str | os.PathLike[str],
    config: Config | str | os.PathLike[str] | None = None,
    *,
    address: str | None = None,
    cpu_node: str | None = None,
    paths: Mapping[str, str | os.PathLike[str]] | None = None,
    progress: ClusterProgressCallback | None = None,
    socket_dir: str | os.PathLike[str] | None = None,
    attach: bool = True,
    **overrides: Any,
) -> ClusterLoad:
    """Load a GGUF model over a Ray cluster: ``async with aiogguf.cluster.load(path,
    n_gpu_layers=-1) as model``. Every node reads its own part from its own storage.

    ``config`` and ``overrides`` are ``aiogguf.load``'s (placement: ``n_gpu_layers``,
    ``split_mode``, ``main_gpu``, ``tensor_split``, ``override`` naming devices by node,
    ``"blk\\.[0-9]\\.=n1/g0"``; ``mode``, ``check_tensors``, ...). ``address``: the Ray
    cluster to join when Ray is not initialised (None: ``ray.init()``'s own choice, which
    is ``RAY_ADDRESS``, else the cluster this machine runs, else a new local one).
    ``cpu_node``: the node that holds the CPU part (default: the driver's). ``paths``:
    the model's path on a node, by node name, where it differs from ``path``.
    ``progress`` is called with a
    ``ClusterProgress`` as the nodes load. Each node serves its part for attach on a
    socket in a private folder it makes under ``socket_dir`` (a folder every node has;
    None: each node's ``$XDG_RUNTIME_DIR``, else its temporary folder):
    ``model.attach_address(node)``; ``attach=False``: no node serves its part (and none
    loads it shareable).

    Raises ``ConfigError`` (bad configuration, unknown node, Ray missing),
    ``PlacementError``, ``LoadError`` naming every node that cannot read its copy
    (before any tensor byte is read), a node that failed, died or stopped answering;
    ``TensorValidationError`` naming every bad tensor of every node, with its node.
    """
    return ClusterLoad(
        path,
        load_config(config, **overrides),
        address=address,
        cpu_node=cpu_node,
        paths=paths,
        progress=progress,
        socket_dir=socket_dir,
        attach=attach,
    )


@contextmanager
def load_sync(
    path: str | os.PathLike[str],
    config: Config | str | os.PathLike[str] | None = None,
    *,
    address: str | None = None,
    cpu_node: str | None = None,
    paths: Mapping[str, str | os.PathLike[str]] | None = None,
    progress: ClusterProgressCallback | None = None,
    socket_dir: str | os.PathLike[str] | None = None,
    attach: bool = True,
    **overrides: Any,
) -> Iterator[ClusterModel]:
    """``with aiogguf.cluster.load_sync(path) as model``: ``load`` for code without a
    loop; takes and raises what it does."""
    handle = load(
        path,
        config,
        address=address,
        cpu_node=cpu_node,
        paths=paths,
        progress=progress,
        socket_dir=socket_dir,
        attach=attach,
        **overrides,
    )
    model: ClusterModel = run(handle.__aenter__, name="cluster.load_sync")
    try:
        yield model
    finally:
        model.close()


async def plan(
    path: str | os.PathLike[str],
    config: Config | str | os.PathLike[str] | None = None,
    *,
    address: str | None = None,
    cpu_node: str | None = None,
    paths: Mapping[str, str | os.PathLike[str]] | None = None,
    **overrides: Any,
) -> ClusterPlan:
    """Where a load over the cluster would put every tensor, without loading: each
    node's loader describes its devices, one reads the headers. Takes ``load``'s
    arguments; returns the ``ClusterPlan`` (``.plan`` is an ``aiogguf.plan`` over the
    union of the nodes' devices, named by node). Raises what ``load`` raises before it
    reads (a node that cannot read is in ``ClusterPlan.nodes``, not an error)."""
    resolved = load_config(config, **overrides)
    ray = await anyio.to_thread.run_sync(_connect, address)
    names, mine = await anyio.to_thread.run_sync(_alive_nodes, ray)
    fspaths = {k: os.fspath(v) for k, v in (paths or {}).items()}
    _check_paths(fspaths, names)
    chosen = cpu_node or names.get(mine or "", order_nodes(names.values())[0])
    loaders = _Loaders(ray, names)
    try:
        made, _, _ = await _make_plan(loaders, os.fspath(path), fspaths, resolved, chosen)
    finally:
        await loaders.stop()
    return made


def plan_sync(
    path: str | os.PathLike[str],
    config: Config | str | os.PathLike[str] | None = None,
    *,
    address: str | None = None,
    cpu_node: str | None = None,
    paths: Mapping[str, str | os.PathLike[str]] | None = None,
    **overrides: Any,
) -> ClusterPlan:
    """``plan`` for code without a loop (blocking; runs an event loop of its own)."""
    result: ClusterPlan = run(
        functools.partial(
            plan, path, config, address=address, cpu_node=cpu_node, paths=paths, **overrides
        ),
        name="cluster.plan_sync",
    )
    return result
