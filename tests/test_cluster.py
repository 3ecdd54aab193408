"""A load over a real Ray cluster on this machine: three nodes (three raylets, each
with its own label and two simulated GPUs from its own environment), every process
on 127.0.0.1, started once for the module (``aiogguf.testing.cluster``).

Marked ``cluster``: left out of the default run (Ray starts a dozen processes), run by
``pytest -m cluster`` in CI's step of its own, with the extra installed.
"""

from __future__ import annotations

import os

# Read when Ray is imported: off, Ray takes loopback for this machine's address.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

ray = pytest.importorskip("ray")
gguf = pytest.importorskip("gguf")

import aiogguf  # noqa: E402
import aiogguf.cluster  # noqa: E402
from aiogguf.cli import main  # noqa: E402
from aiogguf.cluster import ClusterPlan, ClusterProgress  # noqa: E402
from aiogguf.errors import AttachError, LoadError, TensorValidationError  # noqa: E402
from aiogguf.testing.cluster import LoopbackCluster, NodeSpec, loopback_cluster  # noqa: E402
from aiogguf.testing.synth import Corruption, SynthModel, write_synthetic_model  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

# Two GPUs a node; copies at 32 MB/s and small staging slots, so that a load of a few
# tens of MiB lasts long enough to be cancelled midway, and no copy outlasts 0.1 s.
GPU_SPECS = [f"name=g{k},free=2GiB,total=2GiB,bandwidth=32MB" for k in range(6)]
SLOW = {"staging_buffer_size": "1MiB"}
NODES = ["n0", "n1", "n2"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LoopbackCluster]:
    specs = [NodeSpec(name, GPU_SPECS[2 * i : 2 * i + 2]) for i, name in enumerate(NODES)]
    with loopback_cluster(specs) as running:
        yield running
    # Nothing of Ray is left behind: its processes were this one's children.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _ray_children():
        time.sleep(0.1)
    assert _ray_children() == []


def _descendants() -> dict[int, str]:
    """This process's descendants (Ray's processes: the cluster's raylets started them
    all), by pid, with their command lines, from /proc."""
    parents: dict[int, int] = {}
    lines: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            raw = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        lines[int(entry)] = raw.replace(b"\0", b" ").decode(errors="replace")
    found: set[int] = set()
    frontier = {os.getpid()}
    for _ in range(16):  # a tree of bounded depth
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        if not frontier:
            break
        found |= frontier
    return {pid: lines[pid] for pid in found}


def _ray_children() -> list[str]:
    return [line[:80] for line in _descendants().values()]


def _listening() -> list[tuple[int, str]]:
    """``(pid, local address)`` of every listening TCP socket of this process's
    descendants (``ss -tlnp``)."""
    mine = _descendants()
    out = subprocess.run(
        ["ss", "-Htlnp"], capture_output=True, text=True, check=True, timeout=10
    ).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        for pid in re.findall(r"pid=(\d+)", line):
            if int(pid) in mine:
                found.append((int(pid), fields[3]))
    return found


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> SynthModel:
    folder = tmp_path_factory.mktemp("cluster")
    return write_synthetic_model(folder / "m.gguf", size_bytes="16MiB", n_layer=8, seed=3)


def _oracle(path: Path) -> dict[str, bytes]:
    reader = gguf.GGUFReader(path)
    return {t.name: np.asarray(t.data).tobytes() for t in reader.tensors}


def _strip(name: str) -> str:
    return name.partition("/")[2] if "/" in name else name


def _shape(plan: Any) -> dict[str, Any]:
    """A plan with node names taken off its device and buffer type names (and the
    CPU's memory, which the nodes measure at their own moments)."""
    return {
        "mode": plan.mode,
        "input": _strip(plan.input_device),
        "devices": [(_strip(d.name), d.kind) for d in plan.devices],
        "gpu_memory": [(d.free, d.total) for d in plan.devices if d.kind != "cpu"],
        "layers": [(a.layer, _strip(a.device)) for a in plan.layers],
        "tensors": [
            (t.name, _strip(t.device), _strip(t.buffer_type), t.lazy, t.moved) for t in plan.tensors
        ],
        "buffers": [
            (_strip(b.device), _strip(b.buffer_type), b.lazy, b.host, b.tensors, b.ranges)
            for b in plan.buffers
        ],
    }


def test_every_ray_process_listens_on_loopback_only(cluster: LoopbackCluster) -> None:
    listening = _listening()
    assert len(listening) >= 6, "the cluster's processes listen (GCS, raylets, workers)"
    assert [(pid, a) for pid, a in listening if not _loopback(a)] == []


def _loopback(address: str) -> bool:
    """``127.0.0.1:PORT``, ``[::ffff:127.0.0.1]:PORT`` (IPv4 on a v6 socket), ``[::1]:PORT``."""
    host = address.rpartition(":")[0].strip("[]")
    return host.removeprefix("::ffff:") == "127.0.0.1" or host == "::1"


@pytest.mark.parametrize(
    ("placement", "one_machine"),
    [
        ({}, {}),
        ({"n_gpu_layers": 5, "tensor_split": [1, 2, 1, 1, 3, 1]}, None),
        # The CPU part's pinned host memory is its node's (n1 holds g3).
        (
            {"split_mode": "none", "main_gpu": 3, "cpu_node": "n1"},
            {"split_mode": "none", "main_gpu": 3},
        ),
        ({"mode": "none", "n_gpu_layers": 3}, None),
        (
            {"override": [{"pattern": r"blk\.[0-3]\.", "buffer_type": "n1/g2"}]},
            {"override": [{"pattern": r"blk\.[0-3]\.", "buffer_type": "g2"}]},
        ),
        (
            {"mode": "none", "override": [{"pattern": r"ffn", "buffer_type": "CPU"}]},
            None,
        ),
    ],
)
@pytest.mark.asyncio
async def test_the_plan_is_the_one_machine_plan(
    cluster: LoopbackCluster,
    model: SynthModel,
    placement: dict[str, Any],
    one_machine: dict[str, Any] | None,
) -> None:
    """Six GPUs on three nodes are planned for as six GPUs of one machine."""
    over = await aiogguf.cluster.plan(model.path, **placement)
    local = await aiogguf.plan(
        model.path, sim_gpus=GPU_SPECS, **(placement if one_machine is None else one_machine)
    )
    gpus = [d.name for d in over.plan.devices if d.kind != "cpu"]
    assert gpus
    # Node k holds g(2k) and g(2k+1).
    assert all(name == f"n{int(name[-1]) // 2}/g{name[-1]}" for name in gpus), gpus
    assert _shape(over.plan) == _shape(local)


@pytest.mark.asyncio
async def test_a_model_on_six_gpus_of_three_nodes(
    cluster: LoopbackCluster, model: SynthModel
) -> None:
    """Every tensor, fetched back from its node, is gguf-py's; each node read its
    part's ranges and nothing else of the tensor data."""
    seen: list[ClusterProgress] = []
    async with aiogguf.cluster.load(model.path, mode="none", progress=seen.append) as loaded:
        plan = loaded.plan
        assert loaded.nodes == ("n0", "n1", "n2")
        assert {loaded.node_of(t.name) for t in model.tensors} == set(NODES)
        expected = _oracle(model.path)
        for name, data in expected.items():
            assert (await loaded.fetch(name)).tobytes() == data, name
        report = loaded.report
        print(report)
        header = model.tensors[0].file_offset  # the metadata and tensor infos
        for node in NODES:
            row = report.row(node)
            assert row.nbytes == plan.node_bytes(node) > 0
            assert row.read_bytes == plan.node_read_bytes(node)
            # By the kernel's count, the loader's process read its part, its header and
            # little else (Ray's and Python's own reads meanwhile): not another's part.
            smallest_other = min(plan.node_read_bytes(n) for n in NODES if n != node)
            assert row.read_bytes <= row.process_read_bytes, row
            assert row.process_read_bytes - row.read_bytes < min(smallest_other, 4 * 1024**2)
        assert report.nbytes == sum(t.nbytes for t in model.tensors)
        assert loaded.metadata["general.architecture"] == "llama"
    assert seen
    assert seen[-1].bytes_done == seen[-1].bytes_total == report.nbytes
    assert header < 2 * 1024**2


@pytest.mark.asyncio
async def test_the_cpu_part_on_a_named_node(cluster: LoopbackCluster, model: SynthModel) -> None:
    async with aiogguf.cluster.load(
        model.path, n_gpu_layers=4, cpu_node="n2", mode="none"
    ) as loaded:
        plan = loaded.plan.plan
        assert [d.name for d in plan.devices if d.kind == "cpu"] == ["n2/CPU"]
        # Read into memory (mode none), the CPU layers go to the pinned host memory of
        # the CPU node's first GPU, as llama.cpp does on one machine.
        host = [b for b in plan.buffers if b.host]
        assert [b.buffer_type for b in host] == ["n2/g4_Host"]
        cpu_layers = [a.layer for a in plan.layers if a.device == "n2/CPU"]
        assert cpu_layers == list(range(5))  # 9 layers (8 and the output), -ngl 4
        expected = _oracle(model.path)
        assert "token_embd.weight" in host[0].tensors  # the input layer, always the CPU's
        for name in host[0].tensors:
            assert loaded.node_of(name) == "n2"
            assert (await loaded.fetch(name)).tobytes() == expected[name]
        assert loaded.report.row("n2").nbytes == loaded.plan.node_bytes("n2")


@pytest.mark.asyncio
async def test_each_node_reads_its_own_copy(
    cluster: LoopbackCluster, model: SynthModel, tmp_path: Path
) -> None:
    """A per-node path: n2 reads its replica at another path. (Loaded without attach:
    no node serves its part.)"""
    replica = tmp_path / "replica.gguf"
    shutil.copyfile(model.path, replica)
    async with aiogguf.cluster.load(
        model.path, paths={"n2": replica}, mode="none", attach=False
    ) as loaded:
        with pytest.raises(KeyError):
            loaded.attach_address("n2")
        expected = _oracle(model.path)
        n2 = [t.name for t in model.tensors if loaded.node_of(t.name) == "n2"]
        assert n2
        for name in n2:
            assert (await loaded.fetch(name)).tobytes() == expected[name]


@pytest.mark.asyncio
async def test_a_node_that_cannot_read_is_named_before_any_byte(
    cluster: LoopbackCluster, model: SynthModel, tmp_path: Path
) -> None:
    seen: list[ClusterProgress] = []
    with pytest.raises(LoadError) as caught:
        async with aiogguf.cluster.load(
            model.path, paths={"n1": tmp_path / "absent.gguf", "n2": tmp_path}, progress=seen.append
        ):
            pass
    message = str(caught.value)
    assert "node n1 cannot read" in message
    assert "absent.gguf" in message
    assert "node n2 cannot read" in message
    assert "node n0" not in message
    assert seen == []  # no node started its part


@pytest.mark.asyncio
async def test_bad_tensors_on_two_nodes_in_one_error(
    cluster: LoopbackCluster, tmp_path: Path
) -> None:
    names = ["blk.1.attn_norm.weight", "blk.7.attn_norm.weight"]
    bad = write_synthetic_model(
        tmp_path / "bad.gguf",
        size_bytes="16MiB",
        n_layer=8,
        seed=3,
        corruptions=[Corruption(n, "inf_element", 5) for n in names],
    )
    plan = await aiogguf.cluster.plan(bad.path)
    nodes = {n: _node(plan, n) for n in names}
    assert len(set(nodes.values())) == 2, nodes
    with pytest.raises(TensorValidationError) as caught:
        async with aiogguf.cluster.load(bad.path, check_tensors=True):
            pass
    failures = caught.value.failures
    assert sorted(f.name for f in failures) == names
    for f in failures:
        assert f.problem.startswith(f"on node {nodes[f.name]}:")
    assert all(f"on node {node}" in str(caught.value) for node in nodes.values())


def _node(plan: ClusterPlan, tensor: str) -> str:
    return plan.plan.placement(tensor).device.partition("/")[0]


def _loaders_alive() -> list[int]:
    return [pid for pid, line in _descendants().items() if "NodeLoader" in line]


@pytest.mark.asyncio
async def test_cancel_at_30_percent_ends_every_part_within_a_second(
    cluster: LoopbackCluster, tmp_path: Path
) -> None:
    big = write_synthetic_model(tmp_path / "big.gguf", size_bytes="48MiB", n_layer=8, seed=4)
    handle = aiogguf.cluster.load(big.path, mode="none", **SLOW)
    at: list[float] = []
    with anyio.CancelScope() as scope:

        def on_progress(progress: ClusterProgress) -> None:
            if not at and progress.fraction >= 0.3:
                at.append(progress.fraction)
                scope.cancel()

        handle_progress(handle, on_progress)
        async with handle:
            pytest.fail("the load was not cancelled")
    assert at
    assert at[0] < 0.9
    assert set(handle.stopped) == set(NODES)
    assert max(handle.stopped.values()) < 1.0, handle.stopped
    assert handle.held_after == dict.fromkeys(NODES, 0)
    for _ in range(100):  # the killed loaders' processes exit within seconds
        if not _loaders_alive():
            break
        await anyio.sleep(0.1)
    assert _loaders_alive() == []


def handle_progress(handle: aiogguf.cluster.ClusterLoad, callback: Any) -> None:
    handle.progress = callback


def test_the_cli_plans_and_loads_over_the_cluster(
    cluster: LoopbackCluster, model: SynthModel, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["cluster", "plan", str(model.path), "-ngl", "4", "--cpu-node", "n1"]) == 0
    out = capsys.readouterr().out
    for name in ("n1/CPU", "n2/g5", "n0/g0"):
        assert name in out
    assert main(["cluster", "load", str(model.path), "--no-mmap"]) == 0
    out = capsys.readouterr().out
    for node in NODES:
        assert node in out
    assert "total" in out


@pytest.mark.asyncio
async def test_the_readmes_cluster_block_runs(cluster: LoopbackCluster, model: SynthModel) -> None:
    """README's "Beyond one machine" block, its claims asserted, on this cluster."""
    import ast

    from test_readme_python import python_blocks, with_assertions

    blocks = python_blocks("Beyond one machine")
    assert len(blocks) == 1
    source, claims = with_assertions(blocks[0].replace('"model.gguf"', repr(str(model.path))))
    assert claims == 1
    code = compile(source, "README.md", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    namespace: dict[str, Any] = {}
    result = eval(code, namespace)
    if result is not None:
        await result
    assert namespace["norm"].tobytes() == _oracle(model.path)["output_norm.weight"]


@pytest.mark.asyncio
async def test_the_driver_needs_no_copy(
    cluster: LoopbackCluster, model: SynthModel, tmp_path: Path
) -> None:
    """The driver's own path names nothing: every node reads its copy, the plan is made
    on a node, and the tensors are where they belong."""
    nowhere = tmp_path / "not-on-the-driver.gguf"
    async with aiogguf.cluster.load(
        nowhere, paths=dict.fromkeys(NODES, model.path), mode="none"
    ) as loaded:
        assert not nowhere.exists()
        assert loaded.report.nbytes == model.tensor_bytes
        name = model.tensors[-1].name
        assert (await loaded.fetch(name)).tobytes() == _oracle(model.path)[name]


def test_load_sync_for_code_without_a_loop(cluster: LoopbackCluster, model: SynthModel) -> None:
    with aiogguf.cluster.load_sync(model.path, mode="none") as loaded:
        name = model.tensors[3].name
        assert loaded.fetch_sync(name).tobytes() == _oracle(model.path)[name]
        assert loaded.report.nbytes == model.tensor_bytes
    assert "closed" in repr(loaded)
    with pytest.raises(ValueError, match="closed"):
        loaded.fetch_sync(name)


@pytest.mark.asyncio
async def test_each_node_reads_a_remote_source_itself(
    cluster: LoopbackCluster, model: SynthModel
) -> None:
    """A URL: every node requests its own part's ranges from the server, none through
    the driver; together they ask for the model's bytes once, and the headers'."""
    from http_server import file_server

    with file_server(model.path.parent) as server:
        async with aiogguf.cluster.load(server.url(model.path.name)) as loaded:
            assert loaded.plan.plan.mode == "none"  # what a remote source reads in
            expected = _oracle(model.path)
            for t in model.tensors[::7]:
                assert (await loaded.fetch(t.name)).tobytes() == expected[t.name]
            asked = 0
            for headers in server.faults.headers:
                found = re.fullmatch(r"bytes=(\d+)-(\d+)", headers.get("Range", ""))
                if found is not None:
                    asked += int(found[2]) - int(found[1]) + 1
    parts = sum(loaded.plan.node_read_bytes(n) for n in NODES)
    assert parts == model.tensor_bytes
    # Each node (and the planning one once more) reads the header: a few MiB at most.
    assert parts <= asked < parts + 4 * 4 * 1024**2


# An engine on a node: attaches to the node's part by id, checks every tensor it was
# given against gguf-py's, says which, then waits for a line on stdin before it says
# whether the node ended its lease and exits.
_ENGINE = r"""
import sys
import anyio
import gguf
import numpy as np
import aiogguf

socket, model_id, path = sys.argv[1:4]

async def main():
    handle = aiogguf.attach(model_id, socket=socket)
    async with handle as model:
        expected = {t.name: np.asarray(t.data).tobytes() for t in gguf.GGUFReader(path).tensors}
        names = sorted(model.tensors)
        for name in names:
            assert bytes(model.raw(name)) == expected[name], name
        print("attached", ",".join(names), flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)
        print("ended:", handle.lease_ended(), flush=True)

anyio.run(main)
"""


def _engine(address: aiogguf.cluster.AttachAddress, path: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _ENGINE, address.socket, address.model_id, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


async def _line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    with anyio.fail_after(60):  # an interpreter start and an attach, on a loaded machine
        return await anyio.to_thread.run_sync(proc.stdout.readline, abandon_on_cancel=True)


async def _leases_become(loaded: aiogguf.cluster.ClusterModel, want: dict[str, int]) -> None:
    for _ in range(100):  # a lease ends within a second of its process's end
        if await loaded.leases() == want:
            return
        await anyio.sleep(0.05)
    assert await loaded.leases() == want


@pytest.mark.asyncio
async def test_an_engine_on_a_node_attaches_to_its_part(
    cluster: LoopbackCluster, model: SynthModel
) -> None:
    """A process on node n1 attaches to n1's part by the address the driver's model
    gives: it gets n1's tensors alone, equal to gguf-py's; its lease shows while it
    lives and ends with it (killed); closing the model tells a process still attached, and
    removes the socket."""
    parent = tempfile.mkdtemp(prefix="agc")  # short: a socket path has 108 bytes
    engines: list[subprocess.Popen[str]] = []
    try:
        async with aiogguf.cluster.load(model.path, mode="none", socket_dir=parent) as loaded:
            address = loaded.attach_address("n1")
            folder = os.path.dirname(address.socket)
            assert os.path.dirname(folder) == parent
            assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
            assert stat.S_IMODE(os.stat(address.socket).st_mode) == 0o600
            assert len({loaded.attach_address(n).socket for n in NODES}) == 3
            mine = sorted(t.name for t in model.tensors if loaded.node_of(t.name) == "n1")
            assert await loaded.leases() == dict.fromkeys(NODES, 0)

            engines.append(_engine(address, model.path))
            said = await _line(engines[0])
            assert said.split() == ["attached", ",".join(mine)], said
            assert await loaded.leases() == {"n0": 0, "n1": 1, "n2": 0}
            # A node serves its own part only, by its id.
            with pytest.raises(AttachError, match="no model with id"):
                async with aiogguf.attach(
                    loaded.attach_address("n0").model_id, socket=address.socket
                ):
                    pass
            # Killed, it leaves nothing to close: its lease ends with its connection.
            engines[0].kill()
            assert await anyio.to_thread.run_sync(engines[0].wait) == -9
            await _leases_become(loaded, dict.fromkeys(NODES, 0))

            engines.append(_engine(address, model.path))
            assert (await _line(engines[1])).startswith("attached ")
            await _leases_become(loaded, {"n0": 0, "n1": 1, "n2": 0})
        # Closed with an engine attached: it was told, in one line.
        assert engines[1].stdin is not None
        engines[1].stdin.write("\n")
        engines[1].stdin.flush()
        said = (await _line(engines[1])).strip()
        assert said == "ended: the cluster model was closed by its driver (node n1)", said
        assert await anyio.to_thread.run_sync(engines[1].wait) == 0
        assert os.listdir(parent) == []
        for _ in range(100):  # the killed loaders' processes exit within seconds
            if not _loaders_alive():
                break
            await anyio.sleep(0.1)
        assert _loaders_alive() == []
    finally:
        for engine in engines:
            if engine.poll() is None:
                engine.kill()
            engine.communicate(timeout=10)  # its pipes closed
        shutil.rmtree(parent, ignore_errors=True)
