"""The public API: ``aiogguf.load`` (async context manager), progress as a callback and as
an async iterator, ``load_sync``, overrides, asyncio and uvloop."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

import aiogguf
from aiogguf._config import load_config
from aiogguf._events import Progress, Stage
from aiogguf._model import ModelState
from aiogguf.errors import ConfigError, GGUFError, LoadError, os_errors
from aiogguf.io.opener import RootedOpener
from aiogguf.testing.synth import SynthModel, write_synthetic_model


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> SynthModel:
    path = tmp_path_factory.mktemp("api") / "m.gguf"
    return write_synthetic_model(path, size_bytes="4MiB", seed=17, n_layer=4)


def _file_bytes(path: Path, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


def _assert_progress(events: list[Progress], total: int) -> None:
    """Monotone bytes_done, one final DONE event carrying the totals, nothing after it."""
    assert events, "no progress events"
    done = [e.bytes_done for e in events]
    assert done == sorted(done), done
    elapsed = [e.elapsed_s for e in events]
    assert elapsed == sorted(elapsed)
    last = events[-1]
    assert last.stage is Stage.DONE
    assert last.final
    assert [e.stage for e in events].count(Stage.DONE) == 1
    assert last.bytes_done == last.bytes_total == total
    assert last.fraction == 1.0
    assert last.tensors_done == last.tensors_total
    assert events[0].stage is Stage.PARSE


@pytest.mark.asyncio
async def test_progress_callback(model_file: SynthModel) -> None:
    events: list[Progress] = []
    async with aiogguf.load(
        model_file.path, progress=events.append, chunk_size="64KiB", n_gpu_layers=0
    ) as m:
        assert m.report.nbytes == model_file.tensor_bytes
        assert m.report.n_tensors == model_file.n_tensors
        _assert_progress(events, model_file.tensor_bytes)
        assert events[-1].tensors_total == model_file.n_tensors
    assert m.state is ModelState.CLOSED
    # Use after close is the caller's bug, not a bad model: its own error, no GGUFError
    # (which the CLI reports as an invalid model, exit 2).
    with pytest.raises(aiogguf.ClosedResourceError, match="closed") as caught:
        m.tensors[model_file.tensors[0].name]
    assert not isinstance(caught.value, GGUFError)
    assert isinstance(caught.value, ValueError)


@pytest.mark.asyncio
async def test_events_iterated_in_another_task(model_file: SynthModel) -> None:
    handle = aiogguf.load(model_file.path, mode="none", n_gpu_layers=0)
    seen: list[Progress] = []

    async def consume() -> None:
        async for event in handle.events():
            seen.append(event)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await anyio.lowlevel.checkpoint()  # the consumer subscribes before the load starts
            async with handle as model:
                assert len(model.tensors) == model_file.n_tensors
    _assert_progress(seen, model_file.tensor_bytes)


@pytest.mark.asyncio
async def test_events_end_with_failed_on_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 8)
    handle = aiogguf.load(bad, n_gpu_layers=0)
    seen: list[Progress] = []

    async def consume() -> None:
        async for event in handle.events():
            seen.append(event)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await anyio.lowlevel.checkpoint()
            with pytest.raises(GGUFError):
                async with handle:
                    pass
    assert seen
    assert seen[-1].stage is Stage.FAILED
    assert seen[-1].final
    assert str(bad) in seen[-1].message


def test_events_after_the_load_get_the_final_event(model_file: SynthModel) -> None:
    async def main() -> list[Progress]:
        handle = aiogguf.load(model_file.path, n_gpu_layers=0)
        async with handle:
            pass
        return [e async for e in handle.events()]

    late = anyio.run(main)
    assert [e.stage for e in late] == [Stage.DONE]


async def _load_and_check(path: SynthModel) -> str:
    async with aiogguf.load(path.path, mode="none", n_gpu_layers=0) as model:
        t = path.tensors[-1]
        assert bytes(model.raw(t.name)) == _file_bytes(path.path, t.file_offset, t.nbytes)
    return type(asyncio.get_running_loop()).__module__


def test_asyncio_backend(model_file: SynthModel) -> None:
    assert anyio.run(_load_and_check, model_file).startswith("asyncio")


def test_uvloop_backend(model_file: SynthModel) -> None:
    pytest.importorskip("uvloop")
    loop_module = anyio.run(_load_and_check, model_file, backend_options={"use_uvloop": True})
    assert loop_module.startswith("uvloop")


@pytest.mark.asyncio
async def test_concurrent_loads_in_one_loop(model_file: SynthModel, tmp_path: Path) -> None:
    other = write_synthetic_model(tmp_path / "o.gguf", size_bytes="2MiB", seed=3)
    async with anyio.create_task_group() as tg:
        for m in (model_file, other, model_file):
            tg.start_soon(_load_and_check, m)


def test_load_sync(model_file: SynthModel) -> None:
    events: list[Progress] = []
    with aiogguf.load_sync(model_file.path, progress=events.append, n_gpu_layers=0) as model:
        assert model.metadata["general.architecture"] == "llama"
        assert model.metadata["llama.block_count"] == model_file.n_layer
        t = model_file.tensors[0]
        assert bytes(model.raw(t.name)) == _file_bytes(model_file.path, t.file_offset, t.nbytes)
        assert t.name in model.tensors
        assert "nope" not in model.tensors
        with pytest.raises(KeyError):
            model.tensors["nope"]
    assert model.state is ModelState.CLOSED
    _assert_progress(events, model_file.tensor_bytes)


def test_load_sync_takes_an_opener(model_file: SynthModel, tmp_path: Path) -> None:
    """``load_sync`` reads through ``opener`` as ``load`` does: beneath its roots only."""
    with (
        RootedOpener([model_file.path.parent]) as opener,
        aiogguf.load_sync(model_file.path, opener=opener, n_gpu_layers=0) as model,
    ):
        assert model.metadata["general.architecture"] == "llama"
    with (
        RootedOpener([tmp_path]) as opener,
        pytest.raises(aiogguf.PathNotAllowedError),
        aiogguf.load_sync(model_file.path, opener=opener),
    ):
        pass


@pytest.mark.parametrize("mode", ["mmap", "none", "direct"])
def test_mode_override(model_file: SynthModel, mode: str) -> None:
    with aiogguf.load_sync(model_file.path, mode=mode, n_gpu_layers=0) as model:
        assert model.report.mode == model.plan.mode == mode
        assert [f.direct for f in model.report.files] == [mode == "direct"]


def test_check_tensors_override(model_file: SynthModel) -> None:
    with aiogguf.load_sync(model_file.path, check_tensors=False, n_gpu_layers=0) as model:
        assert model.report.validated == 0
    with aiogguf.load_sync(model_file.path, check_tensors=True, n_gpu_layers=0) as model:
        assert model.report.validated == model_file.n_tensors


def test_n_gpu_layers_override(model_file: SynthModel) -> None:
    with aiogguf.load_sync(model_file.path, sim_gpus=["1GiB"], n_gpu_layers=0) as model:
        assert all(b.host for b in model.plan.buffers)
    with aiogguf.load_sync(model_file.path, sim_gpus=["1GiB"], n_gpu_layers=-1) as model:
        assert any(not b.host for b in model.plan.buffers)
        t = model_file.tensors[-1]
        assert bytes(model.raw(t.name)) == _file_bytes(model_file.path, t.file_offset, t.nbytes)


def test_chunk_size_override(model_file: SynthModel) -> None:
    def reads(chunk: str) -> int:
        with aiogguf.load_sync(
            model_file.path, mode="none", chunk_size=chunk, n_gpu_layers=0
        ) as model:
            return sum(f.reads for f in model.report.files)

    big, small = reads("16MiB"), reads("64KiB")
    assert big < small
    assert small >= model_file.tensor_bytes // (64 * 1024)


def test_config_object_and_overrides_together(model_file: SynthModel) -> None:
    config = load_config(None, mode="none")
    with aiogguf.load_sync(model_file.path, config, check_tensors=False, n_gpu_layers=0) as model:
        assert model.report.mode == "none"
        assert model.report.validated == 0


@pytest.mark.parametrize(
    "overrides", [{"no_such_key": 1}, {"mode": "teleport"}, {"chunk_size": "lots"}]
)
def test_bad_override_is_a_config_error(
    model_file: SynthModel, overrides: dict[str, object]
) -> None:
    with pytest.raises(ConfigError):
        aiogguf.load(model_file.path, **overrides)
    with pytest.raises(ConfigError), aiogguf.load_sync(model_file.path, **overrides):
        pass


def test_missing_file_is_a_load_error(tmp_path: Path) -> None:
    with (
        pytest.raises(aiogguf.LoadError, match=r"missing\.gguf"),
        aiogguf.load_sync(tmp_path / "missing.gguf", n_gpu_layers=0),
    ):
        pass


@pytest.mark.asyncio
async def test_a_cancelled_load_ends_with_a_cancelled_event(model_file: SynthModel) -> None:
    """The final event of a cancelled load says so, and keeps the counts it had."""
    seen: list[Progress] = []

    def on_progress(event: Progress) -> None:
        seen.append(event)
        if event.stage is Stage.PLAN:
            scope.cancel()

    with anyio.CancelScope() as scope:
        async with aiogguf.load(
            model_file.path, mode="none", chunk_size="64KiB", progress=on_progress, n_gpu_layers=0
        ):
            pytest.fail("the load was cancelled: the body must not run")
    last = seen[-1]
    assert last.stage is Stage.CANCELLED
    assert last.final
    assert last.message == "cancelled"
    assert (last.bytes_done, last.tensors_done) == (seen[-2].bytes_done, seen[-2].tensors_done)


def test_an_os_error_that_escapes_a_stage_is_a_load_error(
    model_file: SynthModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine is the boundary: a raw ``OSError`` from anywhere in a load reaches
    the caller as a ``LoadError`` naming the model, with the ``OSError`` as its cause."""
    from aiogguf.stages.read import Reader

    def broken(*args: object) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(Reader, "read", broken)
    with pytest.raises(LoadError) as caught, aiogguf.load_sync(model_file.path, n_gpu_layers=0):
        pass
    assert caught.value.path == str(model_file.path)
    assert str(caught.value).endswith("I/O failed: Input/output error")
    assert isinstance(caught.value.__cause__, OSError)
    assert caught.value.__cause__.errno == errno.EIO


def test_os_errors_words_every_io_failure_one_way(tmp_path: Path) -> None:
    with pytest.raises(LoadError) as caught, os_errors(tmp_path / "m.gguf", 4096, "read failed"):
        os.pread(-1, 1, 0)
    assert (
        str(caught.value)
        == f"{tmp_path / 'm.gguf'}: at offset 4096: read failed: Bad file descriptor"
    )
    assert isinstance(caught.value.__cause__, OSError)
    with os_errors(tmp_path, None, "nothing fails"):
        pass


@pytest.mark.parametrize("mode", ["none", "mmap", "direct"])
def test_every_file_is_advised_sequential(
    model_file: SynthModel, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load reads each file front to back: the kernel is told so, which makes a cold
    buffered read go ahead in large steps."""
    from aiogguf.io.files import DataFile, FileAdvice

    advised: list[tuple[str, FileAdvice]] = []
    fadvise = DataFile.fadvise

    def recorded(self: DataFile, advice: FileAdvice, *args: int) -> None:
        advised.append((self.path, advice))
        fadvise(self, advice, *args)

    monkeypatch.setattr(DataFile, "fadvise", recorded)
    with aiogguf.load_sync(model_file.path, mode=mode, n_gpu_layers=0):
        pass
    assert (str(model_file.path), FileAdvice.SEQUENTIAL) in advised


@pytest.mark.parametrize("readers", [1, 2, 3])
def test_a_small_model_is_shared_by_its_readers(model_file: SynthModel, readers: int) -> None:
    """A model smaller than ``readers`` chunks is cut into one job per reader (of at
    least 1 MiB), not read by one reader while the others wait."""
    host_bytes = model_file.tensor_bytes
    with aiogguf.load_sync(
        model_file.path, mode="none", n_gpu_layers=0, readers=readers, chunk_size="64MiB"
    ) as model:
        reads = sum(f.reads for f in model.report.files)
        assert reads >= min(readers, host_bytes // (1 << 20))
        assert reads <= readers + len(model.plan.buffers[0].ranges)
        for t in model_file.tensors:
            want = _file_bytes(model_file.path, t.file_offset, t.nbytes)
            assert bytes(model.raw(t.name)) == want, t.name
