"""``warm_up`` rehearses a load on a model it builds in memory (``aiogguf._core.rehearsal``), so
that the first real load of a process runs on warm code.

The model is checked against ``gguf``'s reader; the rehearsal is checked to go through
the engine once per ``warm_up``, in the mode of the load it prepares, and to leave no
descriptor, thread or warning behind.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

import aiogguf
from aiogguf import _api as api
from aiogguf._config import Config
from aiogguf._core.assemble import read_whole_model
from aiogguf._core.rehearsal import NAME, RehearsalFile, rehearsal_model
from aiogguf._devices import enumerate_devices
from aiogguf.io.opener import OpenFiles
from aiogguf.stages.plan import make_plan


def _open_descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_the_model_reads_the_same_with_gguf(tmp_path: Path) -> None:
    path = tmp_path / "rehearsal.gguf"
    path.write_bytes(rehearsal_model())
    theirs = gguf.GGUFReader(path)
    with OpenFiles() as files:
        parsed, index = read_whole_model(str(path), files)
    assert index is not None
    assert parsed.version == 3
    assert [t.name for t in parsed.tensors] == [t.name for t in theirs.tensors]
    for ours, their in zip(parsed.tensors, theirs.tensors, strict=True):
        assert ours.type.name == their.tensor_type.name
        assert list(ours.shape) == [int(d) for d in their.shape]
        assert parsed.data_offset + ours.offset == their.data_offset
        assert ours.nbytes == their.n_bytes
        assert not np.asarray(their.data).any()  # zeros: every check accepts them
    tokens = theirs.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == len(parsed.metadata["tokenizer.ggml.tokens"].value)
    # Every name is one llama.cpp knows, and the layers are numbered as it numbers them.
    assert index.warnings == ()
    assert index.n_layer == 4
    plan = make_plan(index, enumerate_devices(Config()), Config())
    assert {p.device for p in plan.tensors} == {"CPU"}


def test_the_file_serves_the_model_under_any_name_and_closes() -> None:
    with RehearsalFile() as rehearsal:
        fd = rehearsal.open(NAME)
        try:
            assert os.pread(fd, 4, 0) == b"GGUF"
            assert os.fstat(fd).st_size == len(rehearsal_model())
        finally:
            os.close(fd)
    with pytest.raises(aiogguf.LoadError, match="closed"):
        rehearsal.open(NAME)


@pytest.fixture
def rehearsals(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """The (path, mode) of every load that ``warm_up`` runs."""
    seen: list[tuple[str, str]] = []
    real = api.run_load

    async def recording(path: Any, config: Config, *args: Any, **kwargs: Any) -> Any:
        seen.append((os.fspath(path), config.load.mode))
        return await real(path, config, *args, **kwargs)

    monkeypatch.setattr(api, "run_load", recording)
    return seen


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("mode", "rehearsed"),
    [("mmap", "mmap"), ("mlock", "mlock"), ("none", "none"), ("direct", "none")],
)
@pytest.mark.parametrize("check_tensors", [False, True])
async def test_warm_up_rehearses_once_in_the_load_s_mode(
    rehearsals: list[tuple[str, str]], mode: str, rehearsed: str, check_tensors: bool
) -> None:
    # An anonymous file takes no O_DIRECT: ``direct`` rehearses its buffered path. No
    # warning comes of it (the suite turns warnings into errors).
    before = _open_descriptors()
    warm = await aiogguf.warm_up(mode=mode, check_tensors=check_tensors, n_gpu_layers=0)
    assert rehearsals == [(NAME, rehearsed)]
    assert warm.seconds > 0
    assert _open_descriptors() == before


@pytest.mark.asyncio
async def test_warm_up_rehearses_on_the_simulated_gpu(rehearsals: list[tuple[str, str]]) -> None:
    warm = await aiogguf.warm_up(mode="none", n_gpu_layers=-1, sim_gpus=["1GiB"])
    assert warm.devices == ("g0",)
    assert rehearsals == [(NAME, "none")]


@pytest.mark.asyncio
async def test_warm_up_without_anonymous_files_does_without_a_rehearsal(
    rehearsals: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(name: str, flags: int = 0) -> int:
        raise PermissionError(1, "memfd_create refused by the sandbox")

    monkeypatch.setattr(os, "memfd_create", refused)
    await aiogguf.warm_up(mode="mmap", n_gpu_layers=0)
    assert rehearsals == []


def test_warm_up_sync_rehearses_too(rehearsals: list[tuple[str, str]]) -> None:
    aiogguf.warm_up_sync(mode="mmap", n_gpu_layers=0)
    assert rehearsals == [(NAME, "mmap")]
