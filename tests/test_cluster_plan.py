"""The cluster's plan without Ray (default run): how nodes are named, the union of
their devices, and the core's ``planner`` seam, which loads one node's part of a plan
and allocates and reads nothing of another node's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from aiogguf._api import LoadHandle
from aiogguf._config import load_config
from aiogguf._devices import enumerate_devices
from aiogguf._dry_run import inspect
from aiogguf.cluster._nodes import NodeInfo, describe_device, node_names
from aiogguf.cluster._placement import ClusterPlan, cluster_config, node_part, union_devices
from aiogguf.errors import ConfigError
from aiogguf.io._devices.sim import SimDevice
from aiogguf.stages.plan import make_plan
from aiogguf.testing.synth import SynthModel, write_synthetic_model


def test_nodes_are_named_by_label_else_by_their_place_in_node_id_order() -> None:
    names = node_names(
        [("cc", {}), ("aa", {"aiogguf.node": "head"}), ("bb", {}), ("dd", {"other": "x"})]
    )
    assert names == {"aa": "head", "bb": "n1", "cc": "n2", "dd": "n3"}


@pytest.mark.parametrize(
    "nodes",
    [
        [("aa", {"aiogguf.node": "n1"}), ("bb", {})],  # a label takes an unlabelled name
        [("aa", {"aiogguf.node": "x"}), ("bb", {"aiogguf.node": "x"})],
        [("aa", {"aiogguf.node": "a/b"})],  # a separator in a device name
    ],
)
def test_node_names_that_cannot_serve_are_refused(nodes: list[tuple[str, dict[str, str]]]) -> None:
    with pytest.raises(ConfigError, match=r"aiogguf\.node"):
        node_names(nodes)


def _node(name: str, specs: list[str]) -> tuple[NodeInfo, tuple[object, ...]]:
    devices = enumerate_devices(load_config(sim_gpus=specs))
    info = NodeInfo(
        name,
        f"id-{name}",
        tuple(describe_device(d, name) for d in devices),
        1 << 34,
        1 << 35,
        "m.gguf",
        None,
    )
    return info, devices


@pytest.fixture
def model(tmp_path: Path) -> SynthModel:
    return write_synthetic_model(tmp_path / "m.gguf", size_bytes="4MiB", n_layer=4, seed=9)


@pytest.mark.asyncio
async def test_a_load_of_one_nodes_part_reads_only_that_part(model: SynthModel) -> None:
    a, a_devices = _node("a", ["name=g0,free=1GiB", "name=g1,free=1GiB"])
    b, _ = _node("b", ["name=g2,free=1GiB"])
    index = await inspect(model.path)
    config = load_config(mode="none")
    plan = ClusterPlan(make_plan(index, union_devices((a, b), "a"), config), (a, b), "a")
    assert plan.loading_nodes() == ["a", "b"]
    part = node_part(plan.plan, "a")
    assert {buffer.device for buffer in part.buffers} == {"g0", "g1"}
    assert {buffer.buffer_type for buffer in part.buffers} == {"g0", "g1", "g0_Host"}

    handle = LoadHandle(
        model.path, config, devices=a_devices, planner=lambda index, devices, config: part
    )
    async with handle as loaded:
        held = {t.name for t in part.tensors}
        assert loaded.report.nbytes == plan.node_bytes("a") < model.tensor_bytes
        assert sum(f.nbytes for f in loaded.report.files) == plan.node_read_bytes("a")
        data = model.path.read_bytes()
        for t in model.tensors:
            if t.name in held:
                raw = np.frombuffer(loaded.raw(t.name), dtype=np.uint8)
                assert raw.tobytes() == data[t.file_offset : t.file_offset + t.nbytes]
        # b's GPU was never planned for here, and a's own GPUs hold a's buffers only.
        sims = [d for d in a_devices if isinstance(d, SimDevice)]
        on_gpus = sum(b.nbytes for b in part.buffers if not b.host)
        assert sum(d.live.buffer_bytes for d in sims) >= on_gpus > 0


def test_an_override_to_cpu_names_the_cpu_nodes_cpu() -> None:
    config = load_config(override=[{"pattern": "ffn", "buffer_type": "CPU"}])
    assert cluster_config(config, "n2").placement.override[0].buffer_type == "n2/CPU"


def test_only_the_cpu_nodes_gpus_offer_pinned_host_memory() -> None:
    a, _ = _node("a", ["name=g0"])
    b, _ = _node("b", ["name=g1"])
    devices = union_devices((a, b), "b")
    assert [d.name for d in devices] == ["b/CPU", "a/g0", "b/g1"]
    assert [d.host_buffer_type is not None for d in devices[1:]] == [False, True]
    with pytest.raises(ConfigError, match="no node named 'c'"):
        union_devices((a, b), "c")


def test_the_cli_imports_neither_ray_nor_the_wing_to_build_its_parser() -> None:
    """``aiogguf cluster`` is a command like the others; Ray is imported when it runs."""
    import subprocess
    import sys

    code = (
        "import sys; from aiogguf.cli import build_parser; build_parser(); "
        "print('ray' in sys.modules, 'aiogguf.cluster' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.split() == ["False", "False"]


def test_a_cluster_command_with_a_bad_path_flag_is_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from aiogguf.cli import main

    assert main(["cluster", "plan", "m.gguf", "--path", "n1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--path" in err
    assert "NODE=PATH" in err
