"""Every example in ``configs/`` validates and plans a small synthetic model (and loads it,
once ``aiogguf.load_sync`` exists)."""

from __future__ import annotations

import asyncio
import shutil
import tomllib
from pathlib import Path

import pytest
from synthetic_index import llama_index

import aiogguf
from aiogguf._config import Config, LoadConfig, PipelineConfig, PlacementConfig
from aiogguf._core.assemble import open_index
from aiogguf._devices import enumerate_devices
from aiogguf._records import Plan, WeightIndex
from aiogguf.stages.plan import make_plan
from aiogguf.testing.synth import write_synthetic_model

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
CONFIG_FILES = sorted(p.name for p in CONFIGS.glob("*.toml"))
REQUIRED = {
    "default.toml",
    "cpu-mmap.toml",
    "gpu-direct.toml",
    "nvme-array.toml",
    "moe-experts-on-cpu.toml",
    "dry-run-2gpu.toml",
}
# The load mode each example resolves to on the CPU (plus its own simulated devices).
MODES = {
    "default.toml": "mmap",
    "cpu-mmap.toml": "mmap",
    "gpu-direct.toml": "direct",
    "nvme-array.toml": "direct",
    "moe-experts-on-cpu.toml": "none",
    "dry-run-2gpu.toml": "mmap",
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, WeightIndex]:
    path = tmp_path_factory.mktemp("model") / "m.gguf"
    # Eight blocks, so that a 3:1 split of the layers reaches the second GPU.
    write_synthetic_model(path, size_bytes="8MiB", n_layer=8)
    return path, asyncio.run(open_index(path))


def _plan(index: WeightIndex, config: Config) -> Plan:
    # cupy=False: the same plan on a machine with GPUs as on CI.
    return make_plan(index, enumerate_devices(config, cupy=False), config)


def test_required_examples_exist() -> None:
    assert set(CONFIG_FILES) >= REQUIRED
    assert set(MODES) == set(CONFIG_FILES), "add the new example's mode to MODES"


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_example_validates_and_round_trips(name: str) -> None:
    config = Config.from_toml(CONFIGS / name)
    assert config.source == str(CONFIGS / name)
    assert Config.from_mapping(tomllib.loads(config.to_toml())) == config.model_copy(
        update={"source": None}
    )


def test_default_toml_lists_every_key_with_its_default() -> None:
    assert Config.from_toml(CONFIGS / "default.toml").model_copy(update={"source": None}) == (
        Config()
    )
    data = tomllib.loads((CONFIGS / "default.toml").read_text())
    # Keys without a TOML form for their default (unset, or arrays of tables), and the
    # one no longer used, are shown commented out.
    commented = {"override", "path", "queue_depth", "manifest"}
    for section, model in (
        ("load", LoadConfig),
        ("placement", PlacementConfig),
        ("pipeline", PipelineConfig),
    ):
        assert set(data[section]) == set(model.model_fields) - commented, section


@pytest.mark.parametrize("name", CONFIG_FILES)
def test_example_plans_synthetic_model(name: str, model: tuple[Path, WeightIndex]) -> None:
    _, index = model
    config = Config.from_toml(CONFIGS / name)
    plan = _plan(index, config)
    assert plan.mode == MODES[name]
    assert {t.name for t in plan.tensors} == {t.name for t in index.tensors}
    devices = {d.name for d in plan.devices}
    assert {t.device for t in plan.tensors} <= devices
    if name == "cpu-mmap.toml":
        # n_gpu_layers = 0 keeps the model on the CPU even with a GPU present.
        gpu = _plan(index, config.with_overrides(sim_gpus=["24GiB"]))
        assert {t.device for t in gpu.tensors} == {"CPU"}
    if name in ("gpu-direct.toml", "default.toml"):
        gpu = _plan(index, config.with_overrides(sim_gpus=["24GiB"]))
        assert {a.device for a in gpu.layers} == {"g0"}
    if name == "dry-run-2gpu.toml":
        assert devices == {"CPU", "g0", "g1"}
        assert {a.device for a in plan.layers} == {"g0", "g1"}  # 3:1
        on_g0 = sum(a.device == "g0" for a in plan.layers)
        assert on_g0 > len(plan.layers) - on_g0


def test_moe_example_puts_experts_on_cpu() -> None:
    experts = [
        (f"blk.{il}.ffn_{kind}_exps.weight", "Q4_K", (256, 512, 4))
        for il in range(2)
        for kind in ("up", "gate", "down")
    ]
    index = llama_index(2, extra=experts)
    config = Config.from_toml(CONFIGS / "moe-experts-on-cpu.toml")
    plan = _plan(index, config.with_overrides(sim_gpus=["24GiB"]))
    for t in plan.tensors:
        # The input layer (token_embd) is always in host memory; the experts by the
        # override, which picks from the CPU list: pinned host memory first.
        on_host = "_exps." in t.name or t.name.startswith("token_embd")
        assert t.buffer_type == ("g0_Host" if on_host else "g0"), t.name


def test_nvme_example_per_disk_readers(tmp_path: Path) -> None:
    config = Config.from_toml(CONFIGS / "nvme-array.toml")
    pipeline = config.pipeline
    assert pipeline.readers_for("/mnt/nvme0/m-00001-of-00003.gguf") == 4
    assert pipeline.readers_for("/mnt/nvme2/m-00003-of-00003.gguf") == 2
    assert pipeline.readers_for("/mnt/nvme2/sata/m-00003-of-00003.gguf") == 1
    assert pipeline.readers_for(tmp_path / "m.gguf") == pipeline.readers

    # The same layout for real: shards on two "disks", linked into one model directory.
    write_synthetic_model(tmp_path / "m.gguf", size_bytes="4MiB", split_count=3)
    shards = sorted(tmp_path.glob("m-*-of-00003.gguf"))
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    disks = [tmp_path / "disk0", tmp_path / "disk1"]
    for i, shard in enumerate(shards):
        disk = disks[i % 2]
        disk.mkdir(exist_ok=True)
        shutil.move(shard, disk / shard.name)
        (model_dir / shard.name).symlink_to(disk / shard.name)
    local = config.with_overrides(
        path=[{"prefix": str(disks[0]), "readers": 3}, {"prefix": str(disks[1]), "readers": 5}]
    )
    links = sorted(model_dir.iterdir())
    assert [local.pipeline.readers_for(p) for p in links] == [3, 5, 3]
    index = asyncio.run(open_index(links[0]))
    plan = _plan(index, local)
    assert len({r.file_index for b in plan.buffers for r in b.ranges}) == 3


@pytest.mark.filterwarnings("ignore")  # direct mode on a tmpfs falls back to "none", warning
@pytest.mark.parametrize("name", CONFIG_FILES)
def test_example_loads_synthetic_model(name: str, model: tuple[Path, WeightIndex]) -> None:
    path, index = model
    config: Config | Path = CONFIGS / name
    if name == "nvme-array.toml":
        # Its prefixes name disks this machine lacks: point one at the model instead.
        config = Config.from_toml(CONFIGS / name).with_overrides(
            path=[{"prefix": str(path.parent), "readers": 3}]
        )
    load_sync = aiogguf.load_sync
    with load_sync(path, config) as loaded:
        assert set(loaded.tensors) == {t.name for t in index.tensors}
