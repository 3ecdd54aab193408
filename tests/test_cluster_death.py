"""A node that dies in the middle of a load over the cluster: its raylet and every
process of it killed (SIGKILL). A cluster of its own (the test takes a node away).

Marked ``cluster``: run by ``pytest -m cluster`` (see tests/test_cluster.py).
"""

from __future__ import annotations

import os

# Read when Ray is imported: off, Ray takes loopback for this machine's address.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

import aiogguf.cluster  # noqa: E402
from aiogguf.cluster import ClusterProgress  # noqa: E402
from aiogguf.errors import LoadError  # noqa: E402
from aiogguf.testing.cluster import LoopbackCluster, NodeSpec, loopback_cluster  # noqa: E402
from aiogguf.testing.synth import write_synthetic_model  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

# Copies at 8 MB/s: each node's part of a 48 MiB model takes about a second.
NODES = ["n0", "n1", "n2"]


@pytest.fixture
def cluster() -> Iterator[LoopbackCluster]:
    # One test takes it (and a node from it): it is down before the benchmark's starts.
    specs = [
        NodeSpec(name, [f"name=g{2 * i + k},free=2GiB,bandwidth=8MB" for k in range(2)])
        for i, name in enumerate(NODES)
    ]
    with loopback_cluster(specs) as running:
        yield running


@pytest.mark.asyncio
async def test_a_node_killed_mid_load_is_one_load_error_naming_it(
    cluster: LoopbackCluster, tmp_path: Path
) -> None:
    model = write_synthetic_model(tmp_path / "m.gguf", size_bytes="48MiB", n_layer=8, seed=5)
    handle = aiogguf.cluster.load(model.path, mode="none", staging_buffer_size="1MiB")
    killed: list[float] = []

    def on_progress(progress: ClusterProgress) -> None:
        n1 = next(n for n in progress.nodes if n[0] == "n1")
        if not killed and progress.fraction >= 0.3:
            assert n1[1] < n1[2], "n1 is still loading"
            cluster.kill("n1")
            killed.append(time.monotonic())

    handle.progress = on_progress
    with pytest.raises(LoadError) as caught:
        async with handle:
            pytest.fail("the load went on without n1")
    seconds = time.monotonic() - killed[0]
    print(f"LoadError {seconds:.2f} s after the kill: {caught.value}")
    assert "node n1" in str(caught.value)
    assert "died" in str(caught.value) or "did not answer" in str(caught.value)
    assert seconds < 10, seconds
    # The others were told to stop and hold nothing.
    assert set(handle.held_after) == {"n0", "n2"}
    assert handle.held_after == {"n0": 0, "n2": 0}


def test_the_benchmark_runs_and_its_rows_add_up(tmp_path: Path) -> None:
    """bench/cluster.py on a small model, in a process of its own with a cluster of its
    own (the killing test's is down by then)."""
    import json
    import subprocess
    import sys

    bench = Path(__file__).resolve().parent.parent / "bench" / "cluster.py"
    out = subprocess.run(
        [
            sys.executable,
            str(bench),
            "--size",
            "32MiB",
            "--pairs",
            "1",
            "--json",
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=100,
        check=True,
    ).stdout
    result = json.loads(out)
    assert result["rows_add_up"] is True
    assert {row["node"] for row in result["runs"]["split"][0]["rows"]} == set(NODES)
    assert [row["node"] for row in result["runs"]["alone"][0]["rows"]] == ["n0"]
    assert result["ratio_load"] > 0
