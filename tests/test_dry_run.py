"""Dry runs through the public API: ``aiogguf.inspect`` and ``aiogguf.plan`` (and their
``_sync`` twins) give what the stages give, honour ``opener=``, and do their blocking work
on borrowed threads, never on the loop's thread."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest

import aiogguf
import aiogguf._core.assemble
import aiogguf._dry_run
from aiogguf._core.assemble import open_index
from aiogguf.cli.plan import plan_to_json
from aiogguf.io.opener import AnyPathOpener, RootedOpener
from aiogguf.testing.synth import SynthModel, write_synthetic_model

SIM = ["name=g0,free=8GiB", "name=g1,free=4GiB"]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> SynthModel:
    path = tmp_path_factory.mktemp("dry") / "m.gguf"
    return write_synthetic_model(path, size_bytes="2MiB", seed=5, n_layer=4)


@pytest.fixture(scope="module")
def split_files(tmp_path_factory: pytest.TempPathFactory) -> SynthModel:
    path = tmp_path_factory.mktemp("dry-split") / "s.gguf"
    return write_synthetic_model(path, size_bytes="2MiB", seed=6, n_layer=4, split_count=3)


@pytest.mark.asyncio
async def test_inspect_gives_the_index(model_file: SynthModel) -> None:
    index = await aiogguf.inspect(model_file.path)
    assert isinstance(index, aiogguf.WeightIndex)
    staged = await open_index(model_file.path)
    assert (index.tensors, index.totals) == (staged.tensors, staged.totals)
    assert index.metadata["llama.block_count"].value == model_file.n_layer


def test_inspect_sync_gives_the_same(model_file: SynthModel) -> None:
    index = aiogguf.inspect_sync(model_file.path)
    assert isinstance(index, aiogguf.WeightIndex)
    assert index.totals.n_tensors == len(model_file.tensors)


@pytest.mark.asyncio
async def test_inspect_parses_every_split(split_files: SynthModel) -> None:
    index = await aiogguf.inspect(split_files.paths[0])
    assert len(index.files) == 3
    assert index.totals.n_tensors == len(split_files.tensors)


def test_plan_gives_the_plan_a_load_would_follow(model_file: SynthModel) -> None:
    plan = aiogguf.plan_sync(model_file.path, n_gpu_layers=-1, sim_gpus=SIM, mode="none")
    assert isinstance(plan, aiogguf.Plan)
    assert plan.mode is aiogguf.LoadMode.NONE
    assert [d.kind for d in plan.devices] == [
        aiogguf.DeviceKind.CPU,
        aiogguf.DeviceKind.GPU,
        aiogguf.DeviceKind.GPU,
    ]
    assert {a.device for a in plan.layers} == {"g0", "g1"}
    # The records are typed, the JSON is the same strings as before.
    data = json.loads(json.dumps(plan_to_json(plan)))
    assert [d["kind"] for d in data["devices"]] == ["cpu", "gpu", "gpu"]
    with aiogguf.load_sync(model_file.path, n_gpu_layers=-1, sim_gpus=SIM, mode="none") as m:
        assert _without_free_memory(m.plan) == _without_free_memory(plan)
        # The CPU's free memory is the machine's, read at each plan: it may change
        # between the two; the simulated GPUs' is fixed.
        assert m.plan.devices[1:] == plan.devices[1:]


def _without_free_memory(plan: aiogguf.Plan) -> aiogguf.Plan:
    return dataclasses.replace(
        plan, devices=tuple(dataclasses.replace(d, free=0) for d in plan.devices)
    )


@pytest.mark.asyncio
async def test_plan_resolves_auto_and_takes_a_config(model_file: SynthModel) -> None:
    config = aiogguf.Config().with_overrides(n_gpu_layers=0)
    plan = await aiogguf.plan(model_file.path, config)
    assert plan.mode is aiogguf.LoadMode.MMAP
    assert {t.device for t in plan.tensors} == {"CPU"}
    with pytest.raises(aiogguf.ConfigError, match="n_gpu_layer"):
        await aiogguf.plan(model_file.path, n_gpu_layer=3)


def test_the_opener_decides_what_is_read(model_file: SynthModel, tmp_path: Path) -> None:
    with RootedOpener([tmp_path]) as opener:
        with pytest.raises(aiogguf.PathNotAllowedError):
            aiogguf.inspect_sync(model_file.path, opener=opener)
        with pytest.raises(aiogguf.PathNotAllowedError):
            aiogguf.plan_sync(model_file.path, opener=opener)
    with RootedOpener([model_file.path.parent]) as opener:
        assert aiogguf.inspect_sync(model_file.path, opener=opener).totals.n_tensors > 0


@pytest.mark.asyncio
async def test_blocking_work_never_runs_on_the_loop_thread(
    model_file: SynthModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop_thread = threading.get_ident()
    ran: dict[str, int] = {}

    def on_a_thread(name: str, fn):  # type: ignore[no-untyped-def]
        def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
            ran[name] = threading.get_ident()
            return fn(*args, **kwargs)

        return wrapped

    for name in ("load_config", "enumerate_devices", "make_plan"):
        monkeypatch.setattr(
            aiogguf._dry_run, name, on_a_thread(name, getattr(aiogguf._dry_run, name))
        )
    monkeypatch.setattr(
        aiogguf._core.assemble,
        "build_index",
        on_a_thread("build_index", aiogguf._core.assemble.build_index),
    )
    real_close = aiogguf._dry_run.OpenFiles.close
    monkeypatch.setattr(aiogguf._dry_run.OpenFiles, "close", on_a_thread("close", real_close))

    class Opener(AnyPathOpener):
        def open(self, path: str) -> int:
            ran["open"] = threading.get_ident()
            return super().open(path)

    await aiogguf.plan(model_file.path, opener=Opener(), sim_gpus=SIM)
    assert set(ran) == {
        "load_config",
        "enumerate_devices",
        "make_plan",
        "build_index",
        "close",
        "open",
    }
    assert loop_thread not in ran.values()
    ran.clear()
    await aiogguf.inspect(model_file.path, opener=Opener())
    assert set(ran) == {"build_index", "close", "open"}
    assert loop_thread not in ran.values()
