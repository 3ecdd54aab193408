"""A model that outlives a block (``open_model`` / ``aclose``), and the errors that say
which call to make instead: ``await aiogguf.load(...)``, a ``_sync`` call in a loop."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

import aiogguf
from aiogguf._model import ModelState
from aiogguf.testing.synth import SynthModel, write_synthetic_model


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> SynthModel:
    folder = tmp_path_factory.mktemp("long")
    return write_synthetic_model(folder / "m.gguf", size_bytes="1MiB", seed=4, n_layer=2)


@pytest.mark.asyncio
async def test_open_model_then_aclose(synth: SynthModel) -> None:
    model = await aiogguf.open_model(synth.path, mode="none", n_gpu_layers=0)
    assert model.state is ModelState.OPEN
    name = synth.tensors[0].name
    assert bytes(model.raw(name))  # usable after the call returned, no block around it
    await model.aclose()
    assert model.state is ModelState.CLOSED
    await model.aclose()  # twice is harmless
    with pytest.raises(aiogguf.ClosedResourceError):
        model.raw(name)


@pytest.mark.asyncio
async def test_a_model_collected_open_is_said(synth: SynthModel) -> None:
    model = await aiogguf.open_model(synth.path, n_gpu_layers=0)
    with pytest.warns(ResourceWarning, match=r"never closed .*aclose"):
        del model  # no cycle holds it: freed here
    gc.collect()


@pytest.mark.asyncio
async def test_awaiting_load_says_async_with(synth: SynthModel) -> None:
    with pytest.raises(TypeError, match=r"async with aiogguf\.load"):
        await aiogguf.load(synth.path)  # type: ignore[misc]


@pytest.mark.asyncio
async def test_sync_calls_in_a_running_loop_name_the_async_api(synth: SynthModel) -> None:
    pattern = r"aiogguf\.load_sync\(\) .*async with aiogguf\.load"
    with pytest.raises(RuntimeError, match=pattern), aiogguf.load_sync(synth.path):
        pass
    with pytest.raises(RuntimeError, match=r"aiogguf\.inspect_sync\(\)"):
        aiogguf.inspect_sync(synth.path)


def test_sync_calls_work_without_a_loop(synth: SynthModel, tmp_path: Path) -> None:
    assert aiogguf.inspect_sync(synth.path).totals.n_tensors == synth.n_tensors
