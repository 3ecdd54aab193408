"""A load leaves no reference cycles: closing a model frees its records (index, plan,
checks, jobs) by reference counting, at once, not at the cyclic collector's next full
pass. Such a pass walks every object of the process with the GIL held, and the objects
a load leaves in cycles are what brings the next one on."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import aiogguf
from aiogguf.testing.synth import write_synthetic_model

pytestmark = pytest.mark.asyncio


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cycles") / "m.gguf"
    write_synthetic_model(path, size_bytes="4MiB", seed=3, n_layer=3)
    return path


@pytest.fixture
def saved_garbage() -> Iterator[list[Any]]:
    """What the collector finds unreachable from here on, kept for the test to see."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield gc.garbage
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def _ours(garbage: list[Any]) -> list[str]:
    return sorted({type(o).__qualname__ for o in garbage if type(o).__module__[:7] == "aiogguf"})


@pytest.mark.parametrize(
    "overrides",
    [
        {"mode": "none"},
        {"mode": "none", "check_tensors": False},
        {"mode": "mmap"},
        {"mode": "direct"},
        {"mode": "none", "sim_gpus": ["1GiB"], "n_gpu_layers": -1},
    ],
    ids=["none", "none-unchecked", "mmap", "direct", "sim-offload"],
)
async def test_a_closed_model_leaves_no_cycles(
    model_path: Path, saved_garbage: list[Any], overrides: dict[str, Any]
) -> None:
    async with aiogguf.load(model_path, **overrides) as model:
        assert (model.report.validated > 0) == overrides.get("check_tensors", True)
        assert len(model.tensors) == len(model.index.tensors)
    del model
    gc.collect()
    assert _ours(saved_garbage) == []
